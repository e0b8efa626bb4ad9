//! Small container images for tests and demos, made without docker: the host's `/bin/sh`
//! and the libraries it links, in the `docker save` archive format (one layer).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Writes a `docker save`-format archive to `archive` holding `/bin/sh` (and what it
/// links) whose default command is `cmd`.
pub fn shell_image(archive: &Path, cmd: &[&str]) -> Result<()> {
    let sh = std::fs::canonicalize("/bin/sh").context("/bin/sh")?;
    let ldd = std::process::Command::new("ldd")
        .arg(&sh)
        .output()
        .context("running ldd")?;
    let mut files: Vec<(PathBuf, PathBuf)> = vec![(sh.clone(), PathBuf::from("bin/sh"))];
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        if let Some(path) = line.split_whitespace().find(|w| w.starts_with('/')) {
            let inside = Path::new(path).strip_prefix("/").context("ldd path")?;
            files.push((PathBuf::from(path), inside.to_path_buf()));
        }
    }
    let mut layer = tar::Builder::new(Vec::new());
    let mut dirs = std::collections::BTreeSet::new();
    for (_, inside) in &files {
        for dir in inside.ancestors().skip(1) {
            if !dir.as_os_str().is_empty() {
                dirs.insert(dir.to_path_buf());
            }
        }
    }
    for dir in &dirs {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_mode(0o755);
        header.set_size(0);
        layer.append_data(&mut header, dir, std::io::empty())?;
    }
    for (host, inside) in &files {
        let bytes = std::fs::read(host).with_context(|| host.display().to_string())?;
        let mut header = tar::Header::new_gnu();
        header.set_mode(0o755);
        header.set_size(bytes.len() as u64);
        layer.append_data(&mut header, inside, bytes.as_slice())?;
    }
    let layer = layer.into_inner()?;
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": cmd, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": []},
    });
    let manifest = serde_json::json!([{
        "Config": "config.json",
        "RepoTags": ["gpunode-test/shell:latest"],
        "Layers": ["layer/layer.tar"],
    }]);
    let mut outer = tar::Builder::new(std::fs::File::create(archive)?);
    for (name, bytes) in [
        ("config.json", serde_json::to_vec(&config)?),
        ("manifest.json", serde_json::to_vec(&manifest)?),
        ("layer/layer.tar", layer),
    ] {
        let mut header = tar::Header::new_gnu();
        header.set_mode(0o644);
        header.set_size(bytes.len() as u64);
        outer.append_data(&mut header, name, bytes.as_slice())?;
    }
    outer.finish()?;
    Ok(())
}
