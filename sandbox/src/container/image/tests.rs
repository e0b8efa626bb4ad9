//! Tests of unpacking image archives (docker save, OCI layout, unsafe entries, limits)
//! and of the image cache.

use super::archive::unpack_archive_limited;
use super::*;
use serde_json::json;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use tar::EntryType;

enum E<'a> {
    File(&'a str, &'a [u8], u32),
    Dir(&'a str),
    Sym(&'a str, &'a str),
    Hard(&'a str, &'a str),
    /// A regular file whose name is written verbatim (the builder refuses `..`).
    Raw(&'a str, &'a [u8]),
}

fn tar_of(entries: &[E]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_size(0);
        match *e {
            E::File(p, data, mode) => {
                h.set_mode(mode);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, p, data).unwrap();
            }
            E::Dir(p) => {
                h.set_entry_type(EntryType::Directory);
                h.set_mode(0o755);
                b.append_data(&mut h, p, io::empty()).unwrap();
            }
            E::Sym(p, t) | E::Hard(p, t) => {
                let sym = matches!(e, E::Sym(..));
                h.set_entry_type(if sym {
                    EntryType::Symlink
                } else {
                    EntryType::Link
                });
                b.append_link(&mut h, p, t).unwrap();
            }
            E::Raw(name, data) => {
                h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name.as_bytes());
                h.set_size(data.len() as u64);
                h.set_cksum();
                b.append(&h, data).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn sha(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn write_tar(path: &Path, members: &[(String, Vec<u8>)]) {
    let files: Vec<E> = members.iter().map(|(n, d)| E::File(n, d, 0o644)).collect();
    fs::write(path, tar_of(&files)).unwrap();
}

fn config_json() -> Vec<u8> {
    let c = json!({"config": {"Env": ["PATH=/usr/bin:/bin", "A=1"], "Entrypoint": null, "Cmd": ["/bin/sh", "-c", "echo hi"], "WorkingDir": "/work"}});
    serde_json::to_vec(&c).unwrap()
}

/// A classic `docker save` archive with the given layer blobs.
fn docker_archive(path: &Path, layers: &[Vec<u8>]) {
    let names: Vec<String> = (0..layers.len())
        .map(|i| format!("l{i}/layer.tar"))
        .collect();
    let manifest = json!([{"Config": "cfg.json", "RepoTags": ["t:latest"], "Layers": names}]);
    let mut members = vec![
        (
            "manifest.json".to_string(),
            serde_json::to_vec(&manifest).unwrap(),
        ),
        ("cfg.json".into(), config_json()),
    ];
    members.extend(names.into_iter().zip(layers.iter().cloned()));
    write_tar(path, &members);
}

fn desc(media: &str, bytes: &[u8]) -> Value {
    json!({"mediaType": media, "digest": format!("sha256:{}", sha(bytes)), "size": bytes.len()})
}

fn blob_member(bytes: &[u8]) -> (String, Vec<u8>) {
    (format!("blobs/sha256/{}", sha(bytes)), bytes.to_vec())
}

fn oci_manifest(layer: &[u8]) -> Vec<u8> {
    let m = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": desc("application/vnd.oci.image.config.v1+json", &config_json()),
        "layers": [desc("application/vnd.oci.image.layer.v1.tar+gzip", layer)]});
    serde_json::to_vec(&m).unwrap()
}

fn unpack_err(archive: &Path, dest: &Path, limit: u64) -> ImageError {
    fs::create_dir_all(dest).unwrap();
    unpack_archive(archive, dest, limit).unwrap_err()
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        out.push(p.clone());
        if fs::symlink_metadata(&p).unwrap().is_dir() {
            walk(&p, out);
        }
    }
}

#[test]
fn docker_save_applies_layers_whiteouts_and_links() {
    let tmp = tempfile::tempdir().unwrap();
    let l1 = tar_of(&[
        E::Dir("etc"),
        E::File("etc/a", b"a", 0o644),
        E::File("etc/b", b"b1", 0o644),
        E::File("data/old/x", b"x", 0o644),
        E::File("keep/y", b"yy", 0o644),
        E::File("bin/sh", b"#!sh", 0o4755),
        E::Raw("/abs/file", b"abs"),
        E::Dir("usr/lib"),
        E::Sym("lib", "usr/lib"),
    ]);
    let l2 = gz(&tar_of(&[
        E::File("etc/.wh.a", b"", 0o644),
        E::File("data/.wh..wh..opq", b"", 0o644),
        E::File("./data/new", b"new", 0o644),
        E::Hard("keep/z", "keep/y"),
        E::File("usr/lib/libc.so", b"libc", 0o644),
    ]));
    let l3 = tar_of(&[E::File("etc/b", b"b3", 0o644)]);
    let archive = tmp.path().join("img.tar");
    docker_archive(&archive, &[l1, l2, l3]);
    let root = tmp.path().join("root");
    fs::create_dir(&root).unwrap();
    let config = unpack_archive(&archive, &root, 1 << 20).unwrap();

    assert!(fs::symlink_metadata(root.join("etc/a")).is_err());
    assert_eq!(fs::read(root.join("etc/b")).unwrap(), b"b3");
    assert!(fs::symlink_metadata(root.join("data/old")).is_err());
    assert_eq!(fs::read(root.join("data/new")).unwrap(), b"new");
    assert_eq!(fs::read(root.join("keep/z")).unwrap(), b"yy");
    assert_eq!(
        fs::read_link(root.join("lib")).unwrap(),
        Path::new("usr/lib")
    );
    assert_eq!(fs::read(root.join("usr/lib/libc.so")).unwrap(), b"libc");
    assert_eq!(fs::read(root.join("abs/file")).unwrap(), b"abs");
    let mode = fs::metadata(root.join("bin/sh"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o755, "executable, setuid stripped");
    let mut all = Vec::new();
    walk(&root, &mut all);
    assert!(
        !all.iter().any(|p| p.to_string_lossy().contains(".wh.")),
        "{all:?}"
    );
    assert!(config.env.contains(&"PATH=/usr/bin:/bin".to_string()));
    assert_eq!(config.cmd, ["/bin/sh", "-c", "echo hi"]);
    assert!(config.entrypoint.is_empty());
    assert_eq!(config.working_dir, "/work");
    // The temporary copy of the outer archive is gone.
    let siblings: Vec<_> = fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(siblings.len(), 2, "{siblings:?}");
}

#[test]
fn oci_layout_picks_amd64_and_checks_digests() {
    let tmp = tempfile::tempdir().unwrap();
    let amd = gz(&tar_of(&[E::File("arch", b"amd64", 0o644)]));
    let arm = tar_of(&[E::File("arch", b"arm64", 0o644)]);
    let (m_amd, m_arm) = (oci_manifest(&amd), oci_manifest(&arm));
    let manifest_type = "application/vnd.oci.image.manifest.v1+json";
    let mut d_arm = desc(manifest_type, &m_arm);
    d_arm["platform"] = json!({"os": "linux", "architecture": "arm64"});
    let mut d_amd = desc(manifest_type, &m_amd);
    d_amd["platform"] = json!({"os": "linux", "architecture": "amd64"});
    let nested =
        serde_json::to_vec(&json!({"schemaVersion": 2, "manifests": [d_arm, d_amd]})).unwrap();
    let index = json!({"schemaVersion": 2, "manifests": [desc("application/vnd.oci.image.index.v1+json", &nested)]});
    let archive = tmp.path().join("oci.tar");
    let mut members: Vec<_> = [&amd, &arm, &m_amd, &m_arm, &nested, &config_json()]
        .iter()
        .map(|b| blob_member(b))
        .collect();
    members.push(("index.json".into(), serde_json::to_vec(&index).unwrap()));
    members.push((
        "oci-layout".into(),
        br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
    ));
    write_tar(&archive, &members);
    let root = tmp.path().join("root");
    fs::create_dir(&root).unwrap();
    let config = unpack_archive(&archive, &root, 1 << 20).unwrap();
    assert_eq!(fs::read(root.join("arch")).unwrap(), b"amd64");
    assert_eq!(config.cmd, ["/bin/sh", "-c", "echo hi"]);

    // The layer blob's bytes do not match the digest it is stored under.
    let index = json!({"manifests": [desc(manifest_type, &m_amd)]});
    let tampered = vec![
        (
            format!("blobs/sha256/{}", sha(&amd)),
            gz(&tar_of(&[E::File("arch", b"evil!", 0o644)])),
        ),
        blob_member(&m_amd),
        blob_member(&config_json()),
        ("index.json".into(), serde_json::to_vec(&index).unwrap()),
    ];
    write_tar(&archive, &tampered);
    let dest = tmp.path().join("dest");
    let err = unpack_err(&archive, &dest, 1 << 20);
    assert!(matches!(err, ImageError::Corrupt { .. }), "{err}");
    assert!(
        err.to_string().contains("layer 1") && err.to_string().contains(&sha(&amd)),
        "{err}"
    );
    assert_eq!(fs::read_dir(&dest).unwrap().count(), 0);
}

#[test]
fn unsafe_entries_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tmp.path().join("outside");
    fs::create_dir(&outside).unwrap();
    let archive = tmp.path().join("img.tar");
    let dest = tmp.path().join("a/dest");

    docker_archive(&archive, &[tar_of(&[E::Raw("../evil", b"x")])]);
    let err = unpack_err(&archive, &dest, 1 << 20);
    assert!(matches!(err, ImageError::Unsafe(_)), "{err}");
    assert!(!tmp.path().join("a/evil").exists());

    let target = outside.to_string_lossy().into_owned();
    docker_archive(
        &archive,
        &[tar_of(&[
            E::Sym("escape", &target),
            E::File("escape/pwned", b"x", 0o644),
        ])],
    );
    let err = unpack_err(&archive, &tmp.path().join("b"), 1 << 20);
    assert!(matches!(err, ImageError::Unsafe(_)), "{err}");
    assert!(!outside.join("pwned").exists());

    docker_archive(&archive, &[tar_of(&[E::Hard("h", "../../outside/f")])]);
    let err = unpack_err(&archive, &tmp.path().join("c"), 1 << 20);
    assert!(matches!(err, ImageError::Unsafe(_)), "{err}");
}

#[test]
fn non_images_get_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let archive = tmp.path().join("x.tar");
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let garbage: Vec<u8> = (0..4096)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 24) as u8 | 0x40
        })
        .collect();
    fs::write(&archive, garbage).unwrap();
    let err = unpack_err(&archive, &tmp.path().join("d1"), 1 << 20);
    assert!(matches!(err, ImageError::NotAnImage(_)), "{err}");

    for (i, content) in [tar_of(&[]), tar_of(&[E::File("hello.txt", b"hi", 0o644)])]
        .into_iter()
        .enumerate()
    {
        fs::write(&archive, content).unwrap();
        let err = unpack_err(&archive, &tmp.path().join(format!("e{i}")), 1 << 20);
        assert!(matches!(err, ImageError::NotAnImage(_)), "{err}");
        assert!(err.to_string().contains("neither manifest.json"), "{err}");
    }

    docker_archive(&archive, &[vec![0x28, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0]]);
    let err = unpack_err(&archive, &tmp.path().join("z"), 1 << 20);
    assert!(matches!(err, ImageError::Layer { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("zstd-compressed layers are not supported"),
        "{err}"
    );
}

#[test]
fn cache_reuses_images_and_leaves_nothing_on_failure() {
    let tmp = tempfile::tempdir().unwrap();
    let archive = tmp.path().join("img.tar");
    docker_archive(
        &archive,
        &[tar_of(&[E::File("etc/os-release", b"ID=test", 0o644)])],
    );
    let dir = tmp.path().join("cache");
    let cache = ImageCache::new(&dir, 1 << 20).unwrap();
    let (rootfs, config) = cache.rootfs(&archive, "abc123").unwrap();
    assert_eq!(rootfs, dir.join("abc123/rootfs"));
    assert_eq!(fs::read(rootfs.join("etc/os-release")).unwrap(), b"ID=test");
    fs::write(rootfs.join("marker"), b"m").unwrap();
    let (again, config2) = cache.rootfs(&archive, "abc123").unwrap();
    assert_eq!(again, rootfs);
    assert_eq!(config2, config);
    assert!(
        again.join("marker").exists(),
        "the image was unpacked again"
    );

    let bad = tmp.path().join("bad.tar");
    fs::write(&bad, b"not an image at all").unwrap();
    assert!(cache.rootfs(&bad, "bad1").is_err());
    let names: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["abc123"]);

    for digest in ["../x", "", "a/b", "."] {
        assert!(
            matches!(
                cache.rootfs(&archive, digest),
                Err(ImageError::BadDigest(_))
            ),
            "{digest}"
        );
    }
    assert!(!tmp.path().join("x").exists());
}

#[test]
fn the_cache_keeps_a_bounded_number_of_images_evicting_idle_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let archive = tmp.path().join("img.tar");
    docker_archive(&archive, &[tar_of(&[E::File("a", b"a", 0o644)])]);
    let dir = tmp.path().join("cache");
    let mut cache = ImageCache::new(&dir, 1 << 20).unwrap();
    cache.max_images = 2;
    cache.rootfs(&archive, "one").unwrap();
    cache.rootfs(&archive, "two").unwrap();
    // Both in recent use: a third is refused, nothing is evicted.
    let err = cache.rootfs(&archive, "three").unwrap_err();
    assert!(matches!(err, ImageError::CacheFull(2)), "{err}");
    assert!(dir.join("one").exists() && dir.join("two").exists());
    // "one" was last used two days ago: it makes room.
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(2 * 86_400);
    fs::File::options()
        .write(true)
        .open(dir.join("one/config.json"))
        .unwrap()
        .set_modified(old)
        .unwrap();
    cache.rootfs(&archive, "three").unwrap();
    assert!(!dir.join("one").exists());
    assert!(dir.join("two").exists() && dir.join("three").exists());
    // Reuse refreshes an image: "two" stays while it is used.
    cache.rootfs(&archive, "two").unwrap();
}

#[test]
fn images_with_too_many_entries_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let archive = tmp.path().join("img.tar");
    let names: Vec<String> = (0..50).map(|i| format!("f{i}")).collect();
    let entries: Vec<E> = names.iter().map(|n| E::File(n, b"", 0o644)).collect();
    docker_archive(&archive, &[tar_of(&entries)]);
    let dest = tmp.path().join("few");
    fs::create_dir(&dest).unwrap();
    let err = unpack_archive_limited(&archive, &dest, 1 << 20, 40).unwrap_err();
    assert!(matches!(err, ImageError::TooManyEntries), "{err}");
    let dest = tmp.path().join("enough");
    fs::create_dir(&dest).unwrap();
    unpack_archive_limited(&archive, &dest, 1 << 20, 1000).unwrap();
    assert!(dest.join("f49").exists());
}

#[test]
fn too_large_images_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let archive = tmp.path().join("img.tar");
    docker_archive(&archive, &[tar_of(&[E::File("big", &[7u8; 1000], 0o644)])]);
    let err = unpack_err(&archive, &tmp.path().join("small"), 999);
    assert!(matches!(err, ImageError::TooLarge { limit: 999 }), "{err}");
    let ok = tmp.path().join("ok");
    fs::create_dir(&ok).unwrap();
    unpack_archive(&archive, &ok, 1000).unwrap();
    assert_eq!(fs::metadata(ok.join("big")).unwrap().len(), 1000);
}
