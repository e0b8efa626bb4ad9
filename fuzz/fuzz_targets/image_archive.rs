//! Container image archives (tar, gzip, OCI and docker-save manifests, layers) unpacked
//! into a scratch directory with a small size cap.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(dir) = tempfile::tempdir() else { return };
    let archive = dir.path().join("image.tar");
    if std::fs::write(&archive, data).is_err() {
        return;
    }
    let dest = dir.path().join("root");
    if std::fs::create_dir(&dest).is_err() {
        return;
    }
    let _ = gpunode_sandbox::container::image::unpack_archive(&archive, &dest, 1 << 20);
});
