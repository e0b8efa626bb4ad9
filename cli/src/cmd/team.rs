//! `gpunode team ...`: create a private team, invite, join, list, add, revoke, leave.
//! Joining and leaving change who a node talks to, so they need the daemon stopped;
//! invites need it running (it answers the join); the rest work either way.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use gpunode_node::api::{ApiClient, InviteBody, MemberBody};
use gpunode_node::team::service::{Team, TeamView, SYNC_EVERY};
use gpunode_node::team::{TeamOpError, TeamState};
use gpunode_node::DataDir;
use gpunode_protocol::team::{InviteToken, Role};
use gpunode_protocol::time::now_ms;
use gpunode_protocol::units::parse_duration;

use crate::args::{PolicyAction, TeamCommand};
use crate::output::short_peer;
use crate::target::Target;

/// Runs one `gpunode team` subcommand.
pub async fn team(data_dir: DataDir, cmd: TeamCommand) -> Result<ExitCode> {
    let daemon = Target::daemon(&data_dir).await;
    match cmd {
        TeamCommand::Create { name } => create(&data_dir, daemon.is_some(), &name)?,
        TeamCommand::Invite {
            expires,
            uses,
            role,
        } => invite(daemon, &expires, uses, &role).await?,
        TeamCommand::Join { token } => join(&data_dir, daemon.is_some(), &token).await?,
        TeamCommand::Members { json } => members(&data_dir, daemon, json).await?,
        TeamCommand::Add { peer, role } => add(&data_dir, daemon, &peer, &role).await?,
        TeamCommand::Revoke { peer } => revoke(&data_dir, daemon, &peer).await?,
        TeamCommand::Policy { action } => match action {
            PolicyAction::Show => policy_show(&data_dir, daemon).await?,
            PolicyAction::Set { file } => policy_set(&data_dir, daemon, &file).await?,
        },
        TeamCommand::Leave => {
            if daemon.is_some() {
                bail!("stop the daemon first, then leave the team");
            }
            TeamState::leave(data_dir.root())?;
            eprintln!("Left the team; this node is on the public network again.");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpunode team create NAME` (daemon stopped).
fn create(data_dir: &DataDir, daemon: bool, name: &str) -> Result<()> {
    if daemon {
        bail!("stop the daemon first (a node joins its team network when it starts), then run gpunode team create again");
    }
    let root = data_dir.root();
    let key = data_dir.load_or_create_identity()?;
    let state = TeamState::create(root, name, &key, now_ms())?;
    println!("{}", state.team);
    eprintln!(
        "Created team '{}'; this node is its admin and holds the team key ({}/team/team.key, keep it safe).\nStart the node (gpunode serve), then invite machines with gpunode team invite.",
        state.name,
        root.display()
    );
    Ok(())
}

/// `gpunode team invite` (daemon running: it answers the join).
async fn invite(daemon: Option<ApiClient>, expires: &str, uses: u32, role: &str) -> Result<()> {
    let Some(api) = daemon else {
        bail!("gpunode team invite needs the running daemon (gpunode serve): it answers the join");
    };
    let role: Role = role.parse()?;
    let expires = parse_duration(expires).map_err(|e| anyhow::anyhow!("invalid --expires: {e}"))?;
    if expires.is_zero() {
        bail!("invalid --expires: it must be longer than 0");
    }
    let body = InviteBody {
        role,
        uses,
        expires_ms: now_ms() + expires.as_millis() as u64,
    };
    let reply: serde_json::Value = api.post_json("/v1/team/invite", &body).await?;
    let token = reply["token"].as_str().context("no token in the answer")?;
    println!("{token}");
    eprintln!(
        "On the new machine: gpunode team join <token>  (valid {}, {} use(s), role {:?})",
        humanize(expires),
        uses,
        role
    );
    Ok(())
}

/// `gpunode team join TOKEN` (daemon stopped).
async fn join(data_dir: &DataDir, daemon: bool, token: &str) -> Result<()> {
    if daemon {
        bail!("stop the daemon first, then join; start it again afterwards");
    }
    let token = InviteToken::decode(token)?;
    token.check_fresh(now_ms())?;
    let key = data_dir.load_or_create_identity()?;
    let state = gpunode_node::team::join::join(data_dir.root(), &key, &token).await?;
    println!("{}", state.team);
    eprintln!(
        "Joined team {} as {:?} ({} members known). Start the node with gpunode serve: it joins the team network.",
        state.team.short(),
        state.own.cert.role,
        state.members.len()
    );
    Ok(())
}

/// `gpunode team members`.
async fn members(data_dir: &DataDir, daemon: Option<ApiClient>, json: bool) -> Result<()> {
    let view: TeamView = match daemon {
        Some(api) => api.get_json("/v1/team").await?,
        None => {
            let state = TeamState::load(data_dir.root())?.ok_or(TeamOpError::NoTeam)?;
            TeamView::of(&state, &Default::default())
        }
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&view)?);
    } else {
        print_team(&mut std::io::stdout().lock(), &view)?;
    }
    Ok(())
}

/// `gpunode team add PEER` (admins).
async fn add(data_dir: &DataDir, daemon: Option<ApiClient>, peer: &str, role: &str) -> Result<()> {
    let role: Role = role.parse()?;
    match daemon {
        Some(api) => {
            let body = MemberBody {
                peer: peer.to_string(),
                role: Some(role),
            };
            let _: serde_json::Value = api.post_json("/v1/team/add", &body).await?;
        }
        None => offline_admin(data_dir, peer, |state, peer, key, team_key| {
            let cert = state.issue(peer, role, key, team_key, now_ms())?;
            state.admit(cert, now_ms())?;
            Ok(())
        })?,
    }
    eprintln!("Added {} to the team as {role:?}.", short_peer(peer));
    Ok(())
}

/// `gpunode team revoke PEER` (admins).
async fn revoke(data_dir: &DataDir, daemon: Option<ApiClient>, peer: &str) -> Result<()> {
    match daemon {
        Some(api) => {
            let body = MemberBody {
                peer: peer.to_string(),
                role: None,
            };
            let _: serde_json::Value = api.post_json("/v1/team/revoke", &body).await?;
        }
        None => offline_admin(data_dir, peer, |state, peer, key, team_key| {
            state.revoke(peer, key, team_key, now_ms()).map(|_| ())
        })?,
    }
    eprintln!(
        "Revoked {}: members drop it as the revocation reaches them (within about {} s).",
        short_peer(peer),
        2 * SYNC_EVERY.as_secs()
    );
    Ok(())
}

/// `gpunode team policy show`.
async fn policy_show(data_dir: &DataDir, daemon: Option<ApiClient>) -> Result<()> {
    let text = match daemon {
        Some(api) => api.get_text("/v1/team/policy").await?,
        None => offline_team(data_dir)?.policy_text().unwrap_or_default(),
    };
    if text.is_empty() {
        eprintln!("No team policy is set: no quotas, no time windows, equal priorities.");
    } else {
        print!("{text}");
    }
    Ok(())
}

/// `gpunode team policy set FILE` (admins).
async fn policy_set(data_dir: &DataDir, daemon: Option<ApiClient>, file: &Path) -> Result<()> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    let seq = match daemon {
        Some(api) => {
            let reply: serde_json::Value = api
                .post_json("/v1/team/policy", &serde_json::json!({ "text": text }))
                .await?;
            reply["seq"].as_u64().unwrap_or(0)
        }
        None => offline_team(data_dir)?.set_policy(&text)?,
    };
    eprintln!("Team policy version {seq} set; members pick it up as it spreads.");
    Ok(())
}

/// This node's team, loaded from its files while no daemon runs.
fn offline_team(data_dir: &DataDir) -> Result<Arc<Team>> {
    let key = data_dir.load_or_create_identity()?;
    Ok(Team::load(data_dir.root().to_path_buf(), key)?.ok_or(TeamOpError::NoTeam)?)
}

/// An admin change to the team state while no daemon runs: `change` gets the state,
/// the peer named on the command line, this node's key and the team key (if held here);
/// the state is saved only if it succeeds.
fn offline_admin(
    data_dir: &DataDir,
    peer: &str,
    change: impl FnOnce(
        &mut TeamState,
        gpunode_protocol::PeerId,
        &gpunode_protocol::Keypair,
        Option<&gpunode_protocol::Keypair>,
    ) -> Result<(), TeamOpError>,
) -> Result<()> {
    let root = data_dir.root();
    let peer = peer
        .trim()
        .parse()
        .map_err(|_| anyhow::anyhow!("'{peer}' is not a peer id (12D3KooW...)"))?;
    let mut state = TeamState::load(root)?.ok_or(TeamOpError::NoTeam)?;
    let key = data_dir.load_or_create_identity()?;
    let team_key = TeamState::team_keypair(root)?;
    change(&mut state, peer, &key, team_key.as_ref())?;
    state.save(root)?;
    Ok(())
}

fn humanize(d: std::time::Duration) -> String {
    let s = d.as_secs();
    match s {
        s if s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s % 3600 == 0 => format!("{}h", s / 3600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

fn print_team(out: &mut impl Write, v: &TeamView) -> std::io::Result<()> {
    writeln!(
        out,
        "Team {} ({}), this node: {:?}",
        v.team_id, v.name, v.role
    )?;
    writeln!(
        out,
        "{:<54} {:<7} {:<9} {:<8} EXPIRES (unix ms)",
        "PEER", "ROLE", "CONNECTED", "REVOKED"
    )?;
    for m in &v.members {
        writeln!(
            out,
            "{:<54} {:<7} {:<9} {:<8} {}",
            m.peer_id,
            format!("{:?}", m.role).to_lowercase(),
            if m.connected { "yes" } else { "no" },
            if m.revoked { "yes" } else { "no" },
            m.expires_ms
        )?;
    }
    if v.open_invites > 0 {
        writeln!(out, "{} open invite(s)", v.open_invites)?;
    }
    Ok(())
}
