//! Preparing a job on the requester's machine: the task is checked locally (an invalid
//! module never costs a lease), the module and inputs are read and hashed.

use std::path::{Path, PathBuf};

use gpunode_protocol::job::{
    check_relative_path, BlobRef, JobFile, JobSubmit, Program, RequesterMsg, JOB_VERSION,
    MAX_INPUT_FILES, MAX_MESSAGE_BYTES,
};
use gpunode_protocol::lease::LeaseId;

use super::wire;

use super::types::*;
use super::*;

/// One input file on this machine.
pub(crate) struct LocalFile {
    pub(crate) file: JobFile,
    pub(crate) path: PathBuf,
}

/// The job with everything hashed, ready to send to any provider.
pub(crate) struct Prepared {
    /// The module's bytes (wasm jobs; empty for containers).
    pub(crate) module: Vec<u8>,
    /// The image archive on disk (container jobs with an image).
    pub(crate) image: Option<PathBuf>,
    pub(crate) program: Program,
    pub(crate) inputs: Vec<LocalFile>,
}

impl Prepared {
    /// What the provider is sent for this job under `lease_id`.
    pub(crate) fn submit(&self, req: &JobRequest, lease_id: LeaseId) -> JobSubmit {
        JobSubmit {
            version: JOB_VERSION,
            lease_id,
            program: self.program.clone(),
            inputs: self.inputs.iter().map(|f| f.file.clone()).collect(),
            args: req.args.clone(),
            env: req.env.clone(),
            timeout_ms: req.timeout_ms,
        }
    }
}

impl Requester {
    /// Reads, checks and hashes everything the job sends.
    pub(super) async fn prepare(&self, req: &JobRequest) -> Result<Prepared, JobError> {
        if req.timeout_ms == 0 {
            return Err(JobError::Invalid(
                "the timeout must be positive, e.g. --timeout 10m".into(),
            ));
        }
        let (module, image, program) = match &req.container {
            Some(c) => {
                let blob = match &c.image {
                    Some(path) => Some(wire::hash_file(path).await.map_err(|e| {
                        JobError::Invalid(format!("cannot read image {}: {e}", path.display()))
                    })?),
                    None if c.command.is_empty() => {
                        return Err(JobError::Invalid(
                            "--host-env needs a command: gpunode run --backend container --host-env -- python train.py"
                                .into(),
                        ))
                    }
                    None => None,
                };
                let program = Program::Container {
                    image: blob,
                    command: c.command.clone(),
                };
                (Vec::new(), c.image.clone(), program)
            }
            None => {
                let module = self.read_module(req).await?;
                let program = Program::Wasm {
                    module: BlobRef {
                        hash: *blake3::hash(&module).as_bytes(),
                        size: module.len() as u64,
                    },
                    fuel: req.fuel,
                };
                (module, None, program)
            }
        };
        let mut inputs = Vec::new();
        for root in &req.inputs {
            collect_inputs(root, &mut inputs).await?;
        }
        if inputs.len() > MAX_INPUT_FILES {
            return Err(JobError::Invalid(format!(
                "{} input files; at most {MAX_INPUT_FILES} per job (pack them into an archive)",
                inputs.len()
            )));
        }
        let mut seen = std::collections::HashSet::new();
        for f in &inputs {
            if !seen.insert(f.file.path.clone()) {
                return Err(JobError::Invalid(format!(
                    "two inputs are both named '{}' under /input; rename one",
                    f.file.path
                )));
            }
        }
        let prepared = Prepared {
            module,
            image,
            program,
            inputs,
        };
        let size = gpunode_protocol::encoding::encode(&RequesterMsg::Submit(
            prepared.submit(req, LeaseId([0; 16])),
        ))
        .len();
        if size > MAX_MESSAGE_BYTES {
            return Err(JobError::Invalid(format!(
                "the job's description (input names, arguments, environment) takes {size} bytes; at most {MAX_MESSAGE_BYTES} fit: pack the inputs into an archive"
            )));
        }
        Ok(prepared)
    }

    /// The task file's bytes, when it is a small regular file and its module was compiled
    /// and checked here before (still in memory); `None` sends it the long way, which
    /// also says what is wrong with a file that cannot be read. (Opened without waiting,
    /// and read only when it is a regular file: opening or reading a FIFO would block
    /// this async worker until a writer came.)
    fn small_module_checked_before(&self, req: &JobRequest) -> Option<Vec<u8>> {
        use std::io::Read as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&req.module)
            .ok()?;
        let meta = file.metadata().ok()?;
        if !meta.is_file() || meta.len() > SMALL_MODULE_BYTES {
            return None;
        }
        let mut bytes = Vec::new();
        (&mut file)
            .take(SMALL_MODULE_BYTES + 1)
            .read_to_end(&mut bytes)
            .ok()?;
        let small = bytes.len() as u64 <= SMALL_MODULE_BYTES;
        (small && self.executor.checked_in_memory(&bytes, req.fuel.is_some())).then_some(bytes)
    }

    /// Reads the module and checks here that it is a runnable task, so that an invalid
    /// module never costs a lease.
    async fn read_module(&self, req: &JobRequest) -> Result<Vec<u8>, JobError> {
        if let Some(module) = self.small_module_checked_before(req) {
            return Ok(module);
        }
        // Read and checked in one trip to a blocking thread.
        let exec = self.executor.clone();
        let path = req.module.clone();
        let fuel = req.fuel.is_some();
        let read_and_checked = tokio::task::spawn_blocking(move || {
            let module = std::fs::read(&path).map_err(|e| {
                JobError::Invalid(format!("cannot read task file {}: {e}", path.display()))
            })?;
            exec.compile(&module, fuel).map_err(|e| {
                JobError::Invalid(format!("{} is not a runnable task: {e}", path.display()))
            })?;
            Ok(module)
        });
        read_and_checked
            .await
            .map_err(|e| JobError::Invalid(e.to_string()))?
    }
}

/// Task files up to this size that this node checked before are read and recognised
/// here, on the async worker: the hand-off to a blocking thread and back costs more.
const SMALL_MODULE_BYTES: u64 = 256 << 10;

/// Adds `root` (a file, or a directory walked recursively) to `out`, named by its last
/// path component.
async fn collect_inputs(root: &Path, out: &mut Vec<LocalFile>) -> Result<(), JobError> {
    let invalid = |e: std::io::Error, p: &Path| {
        JobError::Invalid(format!("cannot read input {}: {e}", p.display()))
    };
    let name = root
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| JobError::Invalid(format!("input {} has no file name", root.display())))?;
    let mut stack = vec![(root.to_path_buf(), name)];
    while let Some((path, rel)) = stack.pop() {
        let meta = tokio::fs::metadata(&path)
            .await
            .map_err(|e| invalid(e, &path))?;
        if meta.is_dir() {
            let mut dir = tokio::fs::read_dir(&path)
                .await
                .map_err(|e| invalid(e, &path))?;
            while let Some(entry) = dir.next_entry().await.map_err(|e| invalid(e, &path))? {
                let child = entry.file_name().to_string_lossy().into_owned();
                stack.push((entry.path(), format!("{rel}/{child}")));
            }
        } else if meta.is_file() {
            check_relative_path(&rel).map_err(JobError::Invalid)?;
            let blob = wire::hash_file(&path)
                .await
                .map_err(|e| invalid(e, &path))?;
            out.push(LocalFile {
                file: JobFile { path: rel, blob },
                path,
            });
        }
    }
    Ok(())
}
