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

/// `gpunode dashboard`: prints the running daemon's dashboard link and opens it with
/// `$BROWSER` when that is set (and `no_open` is not); exits 1 when there is none.
pub async fn dashboard(data_dir: DataDir, no_open: bool) -> Result<ExitCode> {
    let Some(api) = Target::daemon(&data_dir).await else {
        eprintln!("no gpunode daemon runs with this data dir: start it with `gpunode serve`");
        return Ok(ExitCode::from(1));
    };
    let status: NodeStatus = api.get_json("/v1/status").await?;
    let Some(url) = status.dashboard_url else {
        eprintln!(
            "the daemon serves no dashboard: it is off (dashboard = false) or its port was \
             in use (see the daemon's log; set dashboard_addr in the config)"
        );
        return Ok(ExitCode::from(1));
    };
    println!("{url}");
    match std::env::var("BROWSER") {
        Ok(browser) if !no_open && !browser.trim().is_empty() => {
            // $BROWSER may name several commands separated by ':'; the first is used.
            let command = browser.split(':').next().unwrap_or_default().trim();
            let spawned = std::process::Command::new(command)
                .arg(&url)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn();
            if let Err(e) = spawned {
                eprintln!("could not start $BROWSER ({command}): {e}; open the link above");
            }
        }
        _ => {}
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpunode id`: creates the identity on first use.
pub fn id(data_dir: &DataDir) -> Result<ExitCode> {
    let key = data_dir.load_or_create_identity()?;
    println!("{}", key.public().to_peer_id());
    Ok(ExitCode::SUCCESS)
}
