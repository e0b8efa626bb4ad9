//! The backends a job runs on, off the async workers: the wasm sandbox (a compiled,
//! cached module) or a bubblewrap container (the host environment or an unpacked
//! image) with only the leased GPUs visible.

use gpunode_protocol::job::{JobRefusal, JobRejection, JobSubmit, Program};
use gpunode_sandbox::container::{ContainerLimits, ContainerSpec, Root};
use gpunode_sandbox::wasm::{Limits, Outcome, OutputSink, RunSpec};
use gpunode_sandbox::SandboxError;
use tokio::task::JoinHandle;

use super::workdir::JobDir;
use super::{reject, Admitted, JobService, Ready};
use crate::jobs::JobControl;

/// A running task: its outcome once the sandbox returns.
type Running = JoinHandle<Result<Outcome, SandboxError>>;

impl JobService {
    /// Compiles the module, or unpacks the image (once per image), off the async
    /// workers. A program that cannot run is refused with what is wrong with it.
    pub(super) async fn prepare(&self, program: &Program) -> Result<Ready, JobRejection> {
        let failed = |e: tokio::task::JoinError| reject(JobRefusal::ProviderError, e.to_string());
        match program {
            Program::Wasm { module, fuel } => {
                let module_path = self.blobs.path(&module.hash);
                let exec = self.executor.clone();
                let fuel = fuel.is_some();
                tokio::task::spawn_blocking(move || {
                    let bytes = std::fs::read(&module_path).map_err(|e| e.to_string())?;
                    exec.compile(&bytes, fuel).map_err(|e| e.to_string())
                })
                .await
                .map_err(failed)?
                .map(Ready::Wasm)
                .map_err(|e| reject(JobRefusal::InvalidModule, e))
            }
            Program::Container { image: None, .. } => Ok(Ready::Container(Root::HostEnv)),
            Program::Container {
                image: Some(image), ..
            } => {
                let Some(runtime) = self.containers.clone() else {
                    return Err(reject(
                        JobRefusal::WrongBackend,
                        "this provider does not run containers",
                    ));
                };
                let (archive, digest) = (self.blobs.path(&image.hash), image.hex());
                tokio::task::spawn_blocking(move || runtime.images.rootfs(&archive, &digest))
                    .await
                    .map_err(failed)?
                    .map(|(rootfs, config)| Ready::Container(Root::Image { rootfs, config }))
                    .map_err(|e| {
                        reject(
                            JobRefusal::InvalidModule,
                            format!("the image cannot be used: {e}"),
                        )
                    })
            }
        }
    }

    /// Starts the prepared program on its backend, its stdout and stderr going to
    /// `logs`.
    pub(super) fn execute(
        &self,
        ready: Ready,
        submit: &JobSubmit,
        admitted: &Admitted,
        workdir: &JobDir,
        control: &JobControl,
        logs: (OutputSink, OutputSink),
    ) -> std::io::Result<Running> {
        match ready {
            Ready::Wasm(task) => {
                let spec = RunSpec {
                    args: submit.args.clone(),
                    env: submit.env.clone(),
                    input_dir: Some(workdir.input()),
                    output_dir: workdir.output(),
                    limits: Limits {
                        wall_time: admitted.wall_time,
                        fuel: match submit.program {
                            Program::Wasm { fuel, .. } => fuel,
                            Program::Container { .. } => None,
                        },
                        memory_bytes: admitted.memory_bytes as usize,
                        output_bytes: self.max_job_bytes,
                        ..Limits::default()
                    },
                    stdout: logs.0,
                    stderr: logs.1,
                    cancel: control.cancel.clone(),
                };
                let exec = self.executor.clone();
                Ok(tokio::task::spawn_blocking(move || exec.run(&task, spec)))
            }
            Ready::Container(root) => {
                self.execute_container(root, submit, admitted, workdir, control, logs)
            }
        }
    }

    fn execute_container(
        &self,
        root: Root,
        submit: &JobSubmit,
        admitted: &Admitted,
        workdir: &JobDir,
        control: &JobControl,
        logs: (OutputSink, OutputSink),
    ) -> std::io::Result<Running> {
        let Some(runtime) = self.containers.clone() else {
            return Err(std::io::Error::other("container backend gone"));
        };
        let mut command = match &submit.program {
            Program::Container { command, .. } => command.clone(),
            Program::Wasm { .. } => Vec::new(),
        };
        command.extend(submit.args.iter().cloned());
        let spec = ContainerSpec {
            root,
            command,
            env: submit.env.clone(),
            input_dir: Some(workdir.input()),
            output_dir: workdir.output(),
            gpus: admitted.gpus.clone(),
            limits: ContainerLimits {
                wall_time: admitted.wall_time,
                memory_bytes: admitted.memory_bytes,
                cpu_seconds: admitted.wall_time.as_secs().max(1) * u64::from(admitted.cpus),
                output_bytes: self.max_job_bytes,
                cpus: admitted.cpus,
                ..ContainerLimits::default()
            },
            stdout: logs.0,
            stderr: logs.1,
            cancel: control.cancel.clone(),
            pause: control.pause.clone(),
            on_start: Some({
                let control = control.clone();
                Box::new(move |pid| control.set_root_pid(pid))
            }),
        };
        Ok(tokio::task::spawn_blocking(move || {
            runtime.executor.run(spec)
        }))
    }
}
