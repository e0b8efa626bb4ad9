use super::*;
use crate::encoding;
use crate::time::UnixMillis;
use libp2p_identity::Keypair;

const NOW: UnixMillis = 1_800_000_000_000;
const DAY: u64 = 24 * 3600 * 1000;

struct Team {
    key: Keypair,
    public: Vec<u8>,
    id: TeamId,
}

fn team() -> Team {
    let key = Keypair::generate_ed25519();
    let public = key.public().encode_protobuf();
    let id = TeamId::of_key(&public);
    Team { key, public, id }
}

fn cert(t: &Team, member: &Keypair, role: Role, issuer: PeerId) -> Certificate {
    Certificate {
        version: TEAM_VERSION,
        team: t.id,
        member: member.public().to_peer_id(),
        role,
        issuer,
        serial: 1,
        issued_ms: NOW,
        expires_ms: NOW + DAY,
    }
}

fn by_team(t: &Team, member: &Keypair, role: Role) -> SignedCertificate {
    let c = cert(t, member, role, t.key.public().to_peer_id());
    SignedCertificate::by_team(c, &t.key).expect("sign")
}

#[test]
fn team_ids_print_and_parse() {
    let t = team();
    let text = t.id.to_string();
    assert_eq!(text.len(), 64);
    assert_eq!(text.parse::<TeamId>(), Ok(t.id));
    assert_eq!(t.id.short().len(), 16);
    assert!(
        matches!("xyz".parse::<TeamId>(), Err(TeamError::Malformed(m)) if m.contains("64 hex"))
    );
    assert_eq!("Admin".parse::<Role>(), Ok(Role::Admin));
    assert!("boss".parse::<Role>().is_err());
}

#[test]
fn certificates_from_the_team_key_or_an_admin_verify() {
    let t = team();
    let (admin, member) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
    let admin_cert = by_team(&t, &admin, Role::Admin);
    assert_eq!(admin_cert.verify(&t.id, &t.public, NOW), Ok(()));
    let c = cert(&t, &member, Role::Member, admin.public().to_peer_id());
    let member_cert = SignedCertificate::by_admin(c, &admin, admin_cert.clone()).expect("sign");
    assert_eq!(member_cert.verify(&t.id, &t.public, NOW), Ok(()));
    let bytes = encoding::encode(&member_cert);
    assert_eq!(SignedCertificate::decode(&bytes), Ok(member_cert));
    assert!(SignedCertificate::decode(&bytes[..bytes.len() - 3]).is_err());
}

#[test]
fn bad_certificates_are_refused_with_the_reason() {
    let t = team();
    let (admin, member, other) = (
        Keypair::generate_ed25519(),
        Keypair::generate_ed25519(),
        Keypair::generate_ed25519(),
    );
    let member_by_team = by_team(&t, &member, Role::Member);

    // Expired.
    let late = NOW + 2 * DAY;
    assert!(matches!(
        member_by_team.verify(&t.id, &t.public, late),
        Err(TeamError::Expired(_))
    ));

    // Altered after signing.
    let mut altered = member_by_team.clone();
    altered.cert.role = Role::Admin;
    assert!(matches!(
        altered.verify(&t.id, &t.public, NOW),
        Err(TeamError::BadSignature(_))
    ));

    // For another team.
    let t2 = team();
    assert!(matches!(
        member_by_team.verify(&t2.id, &t2.public, NOW),
        Err(TeamError::WrongTeam { .. })
    ));
    // A team key that is not the one the id names.
    assert!(matches!(
        member_by_team.verify(&t.id, &t2.public, NOW),
        Err(TeamError::BadSignature(_))
    ));

    // Signed by a mere member.
    let c = cert(&t, &other, Role::Member, member.public().to_peer_id());
    let by_member = SignedCertificate::by_admin(c, &member, member_by_team.clone()).expect("sign");
    let err = by_member.verify(&t.id, &t.public, NOW).unwrap_err();
    assert!(err.to_string().contains("not an admin"), "{err}");

    // An admin made by an admin (one level of delegation only).
    let admin_cert = by_team(&t, &admin, Role::Admin);
    let c = cert(&t, &other, Role::Admin, admin.public().to_peer_id());
    let sub_admin = SignedCertificate::by_admin(c, &admin, admin_cert).expect("sign");
    let c = cert(&t, &member, Role::Member, other.public().to_peer_id());
    let deep = SignedCertificate::by_admin(c, &other, sub_admin).expect("sign");
    assert!(matches!(
        deep.verify(&t.id, &t.public, NOW),
        Err(TeamError::BadSignature(_))
    ));

    // Claims the team key signed it, but another key did.
    let c = cert(&t, &member, Role::Member, t.key.public().to_peer_id());
    let forged = SignedCertificate::by_team(c, &other).expect("sign");
    assert!(matches!(
        forged.verify(&t.id, &t.public, NOW),
        Err(TeamError::BadSignature(_))
    ));
}

#[test]
fn revocation_lists_need_the_team_key_or_an_admin() {
    let t = team();
    let (admin, member) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
    let list = |issuer: PeerId| Revocations {
        team: t.id,
        seq: 1,
        revoked: vec![(member.public().to_peer_id(), NOW)],
        issuer,
    };
    let by_key =
        SignedRevocations::sign(list(t.key.public().to_peer_id()), &t.key, None).expect("sign");
    assert_eq!(by_key.verify(&t.id, &t.public, NOW), Ok(()));
    assert!(by_key.contains(&member.public().to_peer_id()));
    let admin_cert = by_team(&t, &admin, Role::Admin);
    let by_admin =
        SignedRevocations::sign(list(admin.public().to_peer_id()), &admin, Some(admin_cert))
            .expect("sign");
    assert_eq!(by_admin.verify(&t.id, &t.public, NOW), Ok(()));
    let member_cert = by_team(&t, &member, Role::Member);
    let by_member = SignedRevocations::sign(
        list(member.public().to_peer_id()),
        &member,
        Some(member_cert),
    )
    .expect("sign");
    assert!(by_member.verify(&t.id, &t.public, NOW).is_err());
    let mut altered = by_key;
    altered.list.revoked.clear();
    assert!(altered.verify(&t.id, &t.public, NOW).is_err());
}

fn token(t: &Team) -> InviteToken {
    InviteToken {
        version: TEAM_VERSION,
        team: t.id,
        team_key: t.public.clone(),
        bootstrap: vec!["/ip4/127.0.0.1/udp/4170/quic-v1/p2p/12D3KooWExample".into()],
        secret: [7; 32],
        inviter: t.key.public().to_peer_id(),
        role: Role::Member,
        expires_ms: NOW + DAY,
    }
}

#[test]
fn tokens_round_trip_and_bad_ones_say_what_is_wrong() {
    let t = team();
    let good = token(&t);
    let text = good.encode();
    assert!(text.starts_with(TOKEN_PREFIX));
    assert_eq!(
        InviteToken::decode(&format!("  {text}\n")),
        Ok(good.clone())
    );
    assert_eq!(good.check_fresh(NOW), Ok(()));

    let err = |s: &str| InviteToken::decode(s).unwrap_err().to_string();
    assert!(err("hello").contains("should start with"));
    let truncated = &text[..text.len() - 7];
    assert!(
        err(truncated).contains("copy it again"),
        "{}",
        err(truncated)
    );
    assert!(err(&text[..TOKEN_PREFIX.len() + 3]).contains("copy it again"));
    let mut altered = text.clone().into_bytes();
    let i = TOKEN_PREFIX.len() + 20;
    altered[i] = if altered[i] == b'A' { b'B' } else { b'A' };
    let altered = String::from_utf8(altered).expect("utf8");
    assert!(err(&altered).contains("checksum") || err(&altered).contains("damaged"));
    assert!(err(&format!("{text}!!")).contains("damaged"));

    // Forged: a team key that does not hash to the team id.
    let mut forged = good.clone();
    forged.team_key = team().public;
    assert!(err(&forged.encode()).contains("forged"));

    // Expired.
    assert!(matches!(
        good.check_fresh(NOW + 2 * DAY),
        Err(TeamError::Expired(_))
    ));
    let join = good.join_keypair().expect("join key");
    assert_eq!(
        join.public().to_peer_id(),
        good.join_keypair().expect("join key").public().to_peer_id(),
        "the secret stands for one join identity"
    );
}

#[test]
fn join_requests_prove_the_node_key_over_the_join_connection() {
    let t = team();
    let (node, join, thief) = (
        Keypair::generate_ed25519(),
        Keypair::generate_ed25519(),
        Keypair::generate_ed25519(),
    );
    let join_peer = join.public().to_peer_id();
    let req = JoinRequest::new(t.id, &node, &join_peer).expect("sign");
    assert_eq!(req.verify(&join_peer), Ok(()));
    // Replayed over another join connection.
    assert!(req.verify(&thief.public().to_peer_id()).is_err());
    // Claiming someone else's peer id.
    let stolen = JoinRequest {
        member: thief.public().to_peer_id(),
        ..req
    };
    assert!(stolen.verify(&join_peer).is_err());
}

fn policy(t: &Team) -> TeamPolicy {
    TeamPolicy {
        team: t.id,
        seq: 1,
        issuer: t.key.public().to_peer_id(),
        allowance: 50.0,
        priority_admin: 10,
        priority_member: 0,
        preempt_lower: false,
        quota: Quota {
            gpu_hours_per_day: Some(8.0),
            gpu_hours_per_week: Some(30.0),
        },
        member_quotas: Vec::new(),
        windows: vec![
            Window {
                kind: JobKind::Interactive,
                days: vec![0, 1, 2, 3, 4],
                start_min: 9 * 60,
                end_min: 18 * 60,
            },
            Window {
                kind: JobKind::Batch,
                days: vec![0, 1, 2, 3, 4],
                start_min: 18 * 60,
                end_min: 9 * 60,
            },
            Window {
                kind: JobKind::Batch,
                days: vec![5, 6],
                start_min: 0,
                end_min: 24 * 60,
            },
        ],
        utc_offset_min: 60,
    }
}

/// Unix ms of 2026-11-30 (a Monday) at `h:m` team time (UTC+1).
fn monday_at(h: u64, m: u64) -> UnixMillis {
    // 2026-11-30 00:00 UTC.
    let midnight_utc: u64 = 1_795_996_800_000;
    midnight_utc + (h * 60 + m) * 60_000 - 3_600_000
}

#[test]
fn windows_follow_team_time() {
    let t = team();
    let p = policy(&t);
    let me = Keypair::generate_ed25519().public().to_peer_id();
    let (weekday, minute, today, _) = p.team_time(monday_at(10, 0));
    assert_eq!((weekday, minute), (0, 600));
    assert_eq!(today, monday_at(0, 0));
    let at = |kind, h, m| p.check(&me, kind, 1, 3_600_000, Used::default(), monday_at(h, m));
    assert_eq!(at(JobKind::Interactive, 10, 0), Ok(()));
    let err = at(JobKind::Batch, 10, 0).unwrap_err();
    assert!(
        err.contains("batch work may run only") && err.contains("mon 10:00"),
        "{err}"
    );
    assert!(err.contains("rule: window"));
    assert_eq!(at(JobKind::Batch, 23, 30), Ok(()), "after 18:00");
    // The night window runs past midnight: Tuesday 08:59 is still Monday night's.
    let tuesday_early = monday_at(8, 59) + 86_400_000;
    assert_eq!(
        p.check(&me, JobKind::Batch, 1, 1, Used::default(), tuesday_early),
        Ok(())
    );
    assert!(at(JobKind::Interactive, 20, 0).is_err());
    // Saturday (five days later) allows batch all day.
    let saturday = monday_at(12, 0) + 5 * 86_400_000;
    assert_eq!(
        p.check(&me, JobKind::Batch, 1, 1, Used::default(), saturday),
        Ok(())
    );
}

#[test]
fn quotas_are_named_when_hit() {
    let t = team();
    let mut p = policy(&t);
    let me = Keypair::generate_ed25519().public().to_peer_id();
    let now = monday_at(10, 0);
    let used = Used {
        today_gpu_ms: 7 * 3_600_000,
        week_gpu_ms: 7 * 3_600_000,
    };
    assert_eq!(
        p.check(&me, JobKind::Interactive, 1, 3_600_000, used, now),
        Ok(())
    );
    let err = p
        .check(&me, JobKind::Interactive, 2, 3_600_000, used, now)
        .unwrap_err();
    assert!(err.contains("gpu_hours_per_day = 8"), "{err}");
    let week = Used {
        today_gpu_ms: 0,
        week_gpu_ms: 29 * 3_600_000,
    };
    let err = p
        .check(&me, JobKind::Interactive, 2, 3_600_000, week, now)
        .unwrap_err();
    assert!(err.contains("gpu_hours_per_week = 30"), "{err}");
    // A named member's own quota replaces the default.
    p.member_quotas.push((
        me,
        Quota {
            gpu_hours_per_day: Some(100.0),
            gpu_hours_per_week: None,
        },
    ));
    assert_eq!(
        p.check(&me, JobKind::Interactive, 2, 3_600_000, week, now),
        Ok(())
    );
    assert_eq!(p.priority(Role::Admin), 10);
}

#[test]
fn policies_need_the_team_key_or_an_admin() {
    let t = team();
    let signed = SignedPolicy::sign(policy(&t), &t.key, None).expect("sign");
    assert_eq!(signed.verify(&t.id, &t.public, 0), Ok(()));
    let mut altered = signed.clone();
    altered.policy.quota.gpu_hours_per_day = None;
    assert!(altered.verify(&t.id, &t.public, 0).is_err());
    let outsider = Keypair::generate_ed25519();
    let mut p = policy(&t);
    p.issuer = outsider.public().to_peer_id();
    assert!(SignedPolicy::sign(p, &outsider, None)
        .expect("sign")
        .verify(&t.id, &t.public, 0)
        .is_err());
}
