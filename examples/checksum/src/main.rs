//! An example gpunode task, built for `wasm32-wasip1`.
//!
//! `checksum` (no arguments): walks `/input`, prints the SHA-256 of every file like
//! `sha256sum` does, and writes the same lines to `/output/SHA256SUMS` plus a one-line
//! summary to `/output/summary.txt`. Exits 1 if there is nothing to hash.
//!
//! `checksum matmul N`: multiplies two deterministic N×N matrices and prints a checksum
//! of the product; the benchmark runs the same kernel natively and as a wasm task.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use sha2::{Digest, Sha256};

fn files_under(root: &Path) -> io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir)? {
            let entry = entry?;
            let path = entry.path();
            if entry.file_type()?.is_dir() {
                stack.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}

fn sha256_file(path: &Path) -> io::Result<(String, u64)> {
    let mut file = fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    let hex = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok((hex, total))
}

fn checksum() -> io::Result<ExitCode> {
    let root = Path::new("/input");
    let files = files_under(root)?;
    if files.is_empty() {
        eprintln!("checksum: nothing under /input; pass files with --input");
        return Ok(ExitCode::from(1));
    }
    let mut sums = String::new();
    let mut bytes = 0u64;
    for path in &files {
        let (hex, n) = sha256_file(path)?;
        bytes += n;
        let rel = path.strip_prefix(root).unwrap_or(path);
        sums.push_str(&format!("{hex}  {}\n", rel.display()));
    }
    io::stdout().write_all(sums.as_bytes())?;
    fs::write("/output/SHA256SUMS", &sums)?;
    let summary = format!("{} files, {bytes} bytes\n", files.len());
    fs::write("/output/summary.txt", &summary)?;
    eprint!("checksum: {summary}");
    Ok(ExitCode::SUCCESS)
}

/// The benchmark kernel: C = A × B for deterministic A and B, then a checksum of C.
fn matmul(n: usize) -> f64 {
    let a: Vec<f64> = (0..n * n).map(|i| ((i * 7) % 13) as f64 * 0.5).collect();
    let b: Vec<f64> = (0..n * n).map(|i| ((i * 5) % 11) as f64 * 0.25).collect();
    let mut c = vec![0f64; n * n];
    for i in 0..n {
        for k in 0..n {
            let aik = a[i * n + k];
            for j in 0..n {
                c[i * n + j] += aik * b[k * n + j];
            }
        }
    }
    c.iter()
        .enumerate()
        .map(|(i, v)| v * ((i % 3) as f64 + 1.0))
        .sum()
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None => match checksum() {
            Ok(code) => code,
            Err(e) => {
                eprintln!("checksum: {e}");
                ExitCode::from(2)
            }
        },
        Some("matmul") => {
            let n = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(256);
            println!("matmul {n}: checksum {:.1}", matmul(n));
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("usage: checksum [matmul N] (unknown argument '{other}')");
            ExitCode::from(2)
        }
    }
}
