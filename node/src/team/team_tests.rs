use super::*;

const NOW: UnixMillis = 1_800_000_000_000;

fn peer() -> (Keypair, PeerId) {
    let k = Keypair::generate_ed25519();
    let p = k.public().to_peer_id();
    (k, p)
}

#[test]
fn create_saves_private_files_and_a_second_team_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (me, my_id) = peer();
    let state = TeamState::create(dir.path(), "lab", &me, NOW).expect("create");
    assert_eq!(state.own.cert.member, my_id);
    assert_eq!(state.own.cert.role, Role::Admin);
    assert_eq!(
        TeamState::load(dir.path()).expect("load"),
        Some(state.clone())
    );
    for f in ["state", "team.key"] {
        let mode = std::fs::metadata(team_dir(dir.path()).join(f))
            .expect("file")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{f}");
    }
    assert!(TeamState::team_keypair(dir.path()).expect("key").is_some());
    assert!(matches!(
        TeamState::create(dir.path(), "again", &me, NOW),
        Err(TeamOpError::AlreadyInTeam(_))
    ));
    assert!(state.allowed(NOW).contains(&my_id));
    TeamState::leave(dir.path()).expect("leave");
    assert_eq!(TeamState::load(dir.path()).expect("load"), None);
    assert!(matches!(
        TeamState::leave(dir.path()),
        Err(TeamOpError::NoTeam)
    ));
}

#[test]
fn invites_admit_their_join_identity_until_used_up_or_expired() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (me, _) = peer();
    let mut state = TeamState::create(dir.path(), "lab", &me, NOW).expect("create");
    let token = state
        .invite(Role::Member, 2, NOW + 1000, vec![], &me, true)
        .expect("invite");
    let join = token.join_keypair().expect("join").public().to_peer_id();
    assert!(state.allowed(NOW).contains(&join));
    assert!(!state.allowed(NOW + 2000).contains(&join), "expired");
    assert_eq!(state.use_invite(&join, NOW), Ok(Role::Member));
    assert!(state.allowed(NOW).contains(&join), "one use left");
    assert_eq!(state.use_invite(&join, NOW), Ok(Role::Member));
    assert!(
        state.allowed(NOW).contains(&join),
        "used up, still reachable to say so"
    );
    assert!(state
        .use_invite(&join, NOW)
        .unwrap_err()
        .contains("used up"));
    assert!(matches!(
        state.invite(Role::Member, 0, NOW + 1000, vec![], &me, true),
        Err(TeamOpError::Invalid(_))
    ));
}

#[test]
fn admins_issue_members_do_not_and_revocation_removes_access() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (creator, _) = peer();
    let team_key = {
        TeamState::create(dir.path(), "lab", &creator, NOW).expect("create");
        TeamState::team_keypair(dir.path())
            .expect("key")
            .expect("exists")
    };
    let mut root = TeamState::load(dir.path()).expect("load").expect("state");
    let (admin, admin_id) = peer();
    let (member, member_id) = peer();
    let admin_cert = root
        .issue(admin_id, Role::Admin, &creator, Some(&team_key), NOW)
        .expect("admin");
    root.admit(admin_cert.clone(), NOW).expect("admit");

    // The admin's own view of the team, as after joining.
    let mut admin_view = TeamState {
        own: admin_cert,
        invites: Vec::new(),
        ..root.clone()
    };
    let member_cert = admin_view
        .issue(member_id, Role::Member, &admin, None, NOW)
        .expect("an admin issues");
    assert!(root.admit(member_cert.clone(), NOW).expect("valid"));
    assert!(
        !root.admit(member_cert.clone(), NOW).expect("valid"),
        "known"
    );
    assert!(root.allowed(NOW).contains(&member_id));

    let member_view = TeamState {
        own: member_cert,
        ..root.clone()
    };
    assert!(matches!(
        member_view.issue(admin_id, Role::Member, &member, None, NOW),
        Err(TeamOpError::NotAdmin)
    ));

    let list = admin_view
        .revoke(member_id, &admin, None, NOW)
        .expect("revoke");
    assert!(root.apply_revocations(list.clone(), NOW).expect("valid"));
    assert!(
        !root.apply_revocations(list, NOW).expect("valid"),
        "not newer"
    );
    assert!(!root.allowed(NOW).contains(&member_id));
    assert!(root.allowed(NOW).contains(&admin_id));
    assert!(root
        .issue(member_id, Role::Member, &creator, Some(&team_key), NOW)
        .is_err());
    // Certificates expire.
    assert!(!root
        .allowed(NOW + CERT_LIFETIME_MS + 3_600_000)
        .contains(&admin_id));
}
