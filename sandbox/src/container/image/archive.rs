//! Reading an image archive: the outer tar (plain or gzip) unpacked to a temporary
//! directory, its `manifest.json` (docker save) or `index.json` (OCI layout) followed to
//! the config and the layers, every blob checked against its sha256 digest, then the
//! layers applied in order by `layers`.

use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::layers::{extract, normalise, Budget, MAX_IMAGE_ENTRIES};
use super::{Ctx, ImageConfig, ImageError, TempDir};

/// Unpacks an archive into `dest` (an existing empty directory); returns its config.
/// On error `dest` may hold part of the image; blob digests are checked before any
/// layer is applied.
pub fn unpack_archive(
    archive: &Path,
    dest: &Path,
    max_unpacked_bytes: u64,
) -> Result<ImageConfig, ImageError> {
    unpack_archive_limited(archive, dest, max_unpacked_bytes, MAX_IMAGE_ENTRIES)
}

/// [`unpack_archive`] with at most `max_entries` archive entries read.
pub(super) fn unpack_archive_limited(
    archive: &Path,
    dest: &Path,
    max_unpacked_bytes: u64,
    max_entries: u64,
) -> Result<ImageConfig, ImageError> {
    let size = fs::metadata(archive)
        .ctx(|| format!("reading {}", archive.display()))?
        .len();
    let parent = dest
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(std::env::temp_dir);
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let outer = TempDir::create(&parent, &format!(".{name}.outer"))?;
    let not_tar = |e: String| {
        ImageError::NotAnImage(format!("{} is not a readable tar archive ({e}); pass the file written by `docker save` or `podman save`", archive.display()))
    };
    let reader = open_maybe_gzip(archive).ctx(|| format!("opening {}", archive.display()))?;
    if reader.zstd {
        return Err(not_tar("it is zstd-compressed; decompress it first".into()));
    }
    // The outer archive may hold uncompressed layers, so its own cap also allows its size.
    let mut outer_budget = Budget {
        left: max_unpacked_bytes.saturating_add(size),
        limit: max_unpacked_bytes.saturating_add(size),
        entries_left: max_entries,
    };
    extract(reader.inner, &outer.0, &mut outer_budget, false, &not_tar)?;
    let outer_root = outer
        .0
        .canonicalize()
        .ctx(|| "resolving the temporary directory".into())?;
    let (config_path, layers) = read_manifest(&outer_root)?;
    let config = parse_config(&config_path)?;
    let mut budget = Budget {
        left: max_unpacked_bytes,
        limit: max_unpacked_bytes,
        entries_left: outer_budget.entries_left,
    };
    for (label, path) in &layers {
        let bad = |reason: String| ImageError::Layer {
            layer: label.clone(),
            reason,
        };
        for whiteouts in [true, false] {
            let r = open_maybe_gzip(path).map_err(|e| bad(e.to_string()))?;
            if r.zstd {
                return Err(bad("zstd-compressed layers are not supported; re-save the image with gzip or uncompressed layers".into()));
            }
            extract(r.inner, dest, &mut budget, whiteouts, &bad)?;
        }
    }
    Ok(config)
}

/// Finds the config blob and the layers (label, path) in order, via `manifest.json`
/// (docker save) or `index.json` (OCI layout).
fn read_manifest(outer: &Path) -> Result<(PathBuf, Vec<(String, PathBuf)>), ImageError> {
    if outer.join("manifest.json").is_file() {
        let json = read_json(&member(outer, "manifest.json")?)?;
        if let Some(m) = json.as_array().and_then(|a| a.first()) {
            let config = m["Config"]
                .as_str()
                .ok_or_else(|| not_image("manifest.json has no Config"))?;
            let config = docker_member(outer, config, "the image config")?;
            let mut layers = Vec::new();
            for (i, l) in m["Layers"].as_array().into_iter().flatten().enumerate() {
                let name = l
                    .as_str()
                    .ok_or_else(|| not_image("manifest.json has a layer that is not a path"))?;
                let label = format!("{} ({name})", i + 1);
                layers.push((
                    label.clone(),
                    docker_member(outer, name, &format!("layer {label}"))?,
                ));
            }
            return Ok((config, layers));
        }
    }
    if !outer.join("index.json").is_file() {
        return Err(not_image("it has neither manifest.json (docker save) nor index.json (OCI layout); pass an archive made by `docker save`, `podman save` or `skopeo copy ... oci-archive:`"));
    }
    let mut json = read_json(&member(outer, "index.json")?)?;
    for _ in 0..8 {
        let Some(list) = json.get("manifests").and_then(Value::as_array) else {
            return oci_image(outer, &json);
        };
        let platform = |d: &&Value, os: &str, arch: Option<&str>| {
            d["platform"]["os"].as_str() == Some(os)
                && arch.is_none_or(|a| d["platform"]["architecture"].as_str() == Some(a))
        };
        let chosen = list
            .iter()
            .find(|d| platform(d, "linux", Some("amd64")))
            .or_else(|| list.iter().find(|d| !platform(d, "unknown", None)))
            .or_else(|| list.first())
            .ok_or_else(|| not_image("its index lists no manifests"))?;
        json = read_json(&blob(outer, chosen, "an image manifest")?)?;
    }
    Err(not_image("its indexes are nested more than 8 deep"))
}

fn oci_image(
    outer: &Path,
    manifest: &Value,
) -> Result<(PathBuf, Vec<(String, PathBuf)>), ImageError> {
    let config = blob(outer, &manifest["config"], "the image config")?;
    let mut layers = Vec::new();
    for (i, l) in manifest["layers"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let label = format!("{} ({})", i + 1, l["digest"].as_str().unwrap_or("?"));
        layers.push((label.clone(), blob(outer, l, &format!("layer {label}"))?));
    }
    Ok((config, layers))
}

fn not_image(msg: &str) -> ImageError {
    ImageError::NotAnImage(msg.to_string())
}

/// The blob named by an OCI descriptor, with its sha256 verified.
fn blob(outer: &Path, desc: &Value, what: &str) -> Result<PathBuf, ImageError> {
    let digest = desc["digest"].as_str().unwrap_or_default();
    match digest.strip_prefix("sha256:") {
        Some(hex) if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
            let path = member(outer, &format!("blobs/sha256/{hex}"))?;
            verify(&path, hex, what)?;
            Ok(path)
        }
        _ => Err(ImageError::NotAnImage(format!(
            "{what} has digest {digest:?}; only sha256 digests are supported"
        ))),
    }
}

/// A `docker save` member; verified when it is named by digest (Docker 25+).
fn docker_member(outer: &Path, name: &str, what: &str) -> Result<PathBuf, ImageError> {
    let path = member(outer, name)?;
    if let Some(hex) = name.strip_prefix("blobs/sha256/").filter(|h| h.len() == 64) {
        verify(&path, hex, what)?;
    }
    Ok(path)
}

fn verify(path: &Path, hex: &str, what: &str) -> Result<(), ImageError> {
    let mut hasher = Sha256::new();
    let mut file = File::open(path).ctx(|| format!("opening {what}"))?;
    io::copy(&mut file, &mut hasher).ctx(|| format!("reading {what}"))?;
    if hex::encode(hasher.finalize()) != hex.to_ascii_lowercase() {
        return Err(ImageError::Corrupt {
            what: what.to_string(),
            digest: format!("sha256:{hex}"),
        });
    }
    Ok(())
}

/// A regular file of the unpacked outer archive, never resolving outside it.
fn member(outer: &Path, name: &str) -> Result<PathBuf, ImageError> {
    let rel = normalise(Path::new(name))?.ok_or_else(|| not_image("a member name is empty"))?;
    let missing = || ImageError::NotAnImage(format!("it names {name} but does not contain it"));
    let path = outer.join(rel).canonicalize().map_err(|_| missing())?;
    if !path.starts_with(outer) {
        return Err(ImageError::Unsafe(format!(
            "archive member {name} points outside the archive"
        )));
    }
    if !path.is_file() {
        return Err(missing());
    }
    Ok(path)
}

fn read_json(path: &Path) -> Result<Value, ImageError> {
    let bytes = fs::read(path).ctx(|| format!("reading {}", path.display()))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        ImageError::NotAnImage(format!("{name} is not valid JSON ({e})"))
    })
}

fn parse_config(path: &Path) -> Result<ImageConfig, ImageError> {
    let json = read_json(path)?;
    let c = &json["config"];
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(String::from))
            .collect()
    };
    Ok(ImageConfig {
        env: strings(&c["Env"]),
        entrypoint: strings(&c["Entrypoint"]),
        cmd: strings(&c["Cmd"]),
        working_dir: c["WorkingDir"].as_str().unwrap_or_default().to_string(),
    })
}

struct Sniffed {
    inner: Box<dyn Read>,
    zstd: bool,
}

/// Opens a tar stream, decompressing gzip when the file starts with its magic.
fn open_maybe_gzip(path: &Path) -> io::Result<Sniffed> {
    let mut reader = BufReader::new(File::open(path)?);
    let head = reader.fill_buf()?;
    let zstd = head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]);
    let inner: Box<dyn Read> = if head.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::read::MultiGzDecoder::new(reader))
    } else {
        Box::new(reader)
    };
    Ok(Sniffed { inner, zstd })
}
