//! `gpunode status` and `gpunode id`: who this node is and, when the daemon runs, what
//! it sees.

use std::process::ExitCode;

use anyhow::Result;
use gpunode_node::{DataDir, NodeStatus};

use crate::args::StatusArgs;
use crate::helpers::print_json;
use crate::output;
use crate::target::Target;

/// `gpunode status`: exits 1 when no daemon runs.
pub async fn status(data_dir: DataDir, args: StatusArgs) -> Result<ExitCode> {
    let Some(api) = Target::daemon(&data_dir).await else {
        print_not_running(&data_dir, args.json)?;
        return Ok(ExitCode::from(1));
    };
    let status: NodeStatus = api.get_json("/v1/status").await?;
    if args.json {
        print_json(&status)?;
    } else {
        output::print_status(&mut std::io::stdout().lock(), &status)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn print_not_running(data_dir: &DataDir, json: bool) -> Result<()> {
    let id = data_dir
        .load_identity()?
        .map(|k| k.public().to_peer_id().to_string())
        .unwrap_or_else(|| "(no identity yet)".to_string());
    if json {
        println!(
            "{}",
            serde_json::json!({"peer_id": id, "running": false, "data_dir": data_dir.root()})
        );
    } else {
        println!("Peer ID:   {id}");
        println!("Data dir:  {}", data_dir.root().display());
        println!("Daemon:    not running (start it with `gpunode serve`)");
    }
    Ok(())
}

/// `gpunode id`: creates the identity on first use.
pub fn id(data_dir: &DataDir) -> Result<ExitCode> {
    let key = data_dir.load_or_create_identity()?;
    println!("{}", key.public().to_peer_id());
    Ok(ExitCode::SUCCESS)
}
