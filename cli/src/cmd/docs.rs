//! `gpunode completions SHELL` and `gpunode man`: shell completion scripts and man pages,
//! generated from the same clap definitions that parse the flags, so they never drift.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::CommandFactory;

use crate::args::Cli;

/// `gpunode completions SHELL`: the script on stdout.
pub fn completions(shell: clap_complete::Shell) -> Result<ExitCode> {
    let mut cmd = Cli::command();
    // Into memory first: the generator panics on a write error (a closed pipe).
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, "gpunode", &mut script);
    std::io::Write::write_all(&mut std::io::stdout().lock(), &script)?;
    Ok(ExitCode::SUCCESS)
}

/// `gpunode man`: the main page on stdout, or with `dir` one page per command and
/// subcommand (`gpunode.1`, `gpunode-serve.1`, `gpunode-team-join.1`, ...) written there.
pub fn man(dir: Option<&Path>) -> Result<ExitCode> {
    let cmd = Cli::command();
    match dir {
        None => {
            let mut page = Vec::new();
            clap_mangen::Man::new(cmd).render(&mut page)?;
            std::io::Write::write_all(&mut std::io::stdout().lock(), &page)?;
        }
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            clap_mangen::generate_to(cmd, dir)
                .with_context(|| format!("cannot write man pages into {}", dir.display()))?;
            println!("man pages written to {}", dir.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}
