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
    // Spent: the join identity is no longer let in, and cannot join again.
    assert!(!state.allowed(NOW).contains(&join), "spent invites close");
    assert!(!state.is_member(&join, NOW));
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

/// A team with its key, an admin `a` (certificate by the team key) and the state the
/// team key holder keeps.
fn team_with_admin() -> (tempfile::TempDir, Keypair, Keypair, TeamState, TeamState) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (creator, _) = peer();
    let mut root = TeamState::create(dir.path(), "lab", &creator, NOW).expect("create");
    let team_key = TeamState::team_keypair(dir.path())
        .expect("read")
        .expect("key");
    let (admin, admin_id) = peer();
    let admin_cert = root
        .issue(admin_id, Role::Admin, &creator, Some(&team_key), NOW)
        .expect("issue");
    assert!(root.admit(admin_cert.clone(), NOW).expect("valid"));
    let admin_view = TeamState {
        own: admin_cert,
        invites: Vec::new(),
        ..root.clone()
    };
    (dir, team_key, admin, root, admin_view)
}

#[test]
fn a_revoked_admin_loses_its_powers_everywhere() {
    let (_dir, team_key, admin, mut root, mut admin_view) = team_with_admin();
    let admin_id = admin.public().to_peer_id();
    let creator_id = root.own.cert.member;
    let (_, member_id) = peer();
    // Before its revocation, the admin signs a member in and a policy.
    let member_cert = admin_view
        .issue(member_id, Role::Member, &admin, None, NOW)
        .expect("issue");
    assert!(root.admit(member_cert.clone(), NOW).expect("valid"));
    assert!(root.is_member(&member_id, NOW));
    // The team key holder revokes the admin.
    let list = root
        .revoke(admin_id, &Keypair::generate_ed25519(), Some(&team_key), NOW)
        .expect("revoke");
    assert!(admin_view.apply_revocations(list, NOW).expect("valid"));
    // Everything the admin signed stops counting: its member is out.
    assert!(!root.is_member(&admin_id, NOW));
    assert!(
        !root.is_member(&member_id, NOW),
        "certificate by a revoked admin"
    );
    assert!(!root.allowed(NOW).contains(&member_id));
    // New certificates it signs are refused (the issuer chain is checked).
    let (_, other_id) = peer();
    let forged = SignedCertificate::by_admin(
        Certificate {
            version: TEAM_VERSION,
            team: root.team,
            member: other_id,
            role: Role::Admin,
            issuer: admin_id,
            serial: 7,
            issued_ms: NOW,
            expires_ms: NOW + 3_600_000,
        },
        &admin,
        admin_view.own.clone(),
    )
    .expect("sign");
    assert!(root.admit(forged, NOW).is_err());
    // Its revocation lists are refused: it cannot revoke the creator in revenge.
    let mut rogue = admin_view.clone();
    rogue.revocations.clear();
    let revenge = rogue.revoke(creator_id, &admin, None, NOW).expect("signs");
    let err = root
        .apply_revocations(revenge, NOW)
        .expect_err("revoked issuer");
    assert!(err.to_string().contains("revoked"), "{err}");
    assert!(root.is_member(&creator_id, NOW));
    // Its policies are refused.
    let policy = gpunode_protocol::team::SignedPolicy::sign(
        super::policy::parse("allowance = 5", root.team, admin_id, 99).expect("policy"),
        &admin,
        Some(admin_view.own.clone()),
    )
    .expect("sign");
    assert!(root.apply_policy(policy, NOW).is_err());
    // And it can no longer issue or revoke from its own node either.
    assert!(admin_view
        .issue(other_id, Role::Member, &admin, None, NOW)
        .is_err());
    assert!(admin_view.revoke(member_id, &admin, None, NOW).is_err());
}

#[test]
fn a_policy_by_an_admin_revoked_since_is_replaced_by_any_valid_one() {
    let (_dir, team_key, admin, mut root, _admin_view) = team_with_admin();
    let admin_id = admin.public().to_peer_id();
    let admin_cert = root
        .members
        .iter()
        .find(|c| c.cert.member == admin_id)
        .cloned()
        .expect("admin");
    // The admin sets a policy with a huge sequence number, to block later ones.
    let blocking = gpunode_protocol::team::SignedPolicy::sign(
        super::policy::parse("allowance = 5", root.team, admin_id, u64::MAX).expect("policy"),
        &admin,
        Some(admin_cert),
    )
    .expect("sign");
    assert!(root.apply_policy(blocking, NOW).expect("valid"));
    root.revoke(admin_id, &Keypair::generate_ed25519(), Some(&team_key), NOW)
        .expect("revoke");
    let team_peer = team_key.public().to_peer_id();
    let fixed = gpunode_protocol::team::SignedPolicy::sign(
        super::policy::parse("allowance = 7", root.team, team_peer, 2).expect("policy"),
        &team_key,
        None,
    )
    .expect("sign");
    assert!(root.apply_policy(fixed, NOW).expect("taken"));
    assert_eq!(root.policy.as_ref().expect("policy").policy.seq, 2);
}

#[test]
fn two_admins_revoking_at_once_lose_nothing() {
    let (_dir, team_key, admin, mut root, admin_view) = team_with_admin();
    // A second admin.
    let (admin2, admin2_id) = peer();
    let cert2 = root
        .issue(
            admin2_id,
            Role::Admin,
            &Keypair::generate_ed25519(),
            Some(&team_key),
            NOW,
        )
        .expect("issue");
    assert!(root.admit(cert2.clone(), NOW).expect("valid"));
    let mut view1 = TeamState {
        members: root.members.clone(),
        ..admin_view
    };
    let mut view2 = TeamState {
        own: cert2,
        ..view1.clone()
    };
    let (_, x) = peer();
    let (_, y) = peer();
    // Both revoke someone at the same moment, each unaware of the other.
    let l1 = view1.revoke(x, &admin, None, NOW).expect("revoke x");
    let l2 = view2.revoke(y, &admin2, None, NOW).expect("revoke y");
    assert_eq!(l1.list.seq, l2.list.seq, "same sequence number");
    // Every node that hears both keeps both.
    for node in [&mut root, &mut view1, &mut view2] {
        let _ = node.apply_revocations(l1.clone(), NOW).expect("valid");
        let _ = node.apply_revocations(l2.clone(), NOW).expect("valid");
        assert!(node.is_revoked(&x) && node.is_revoked(&y));
    }
    // An old list of one issuer never replaces its newer one.
    let l1b = view1.revoke(y, &admin, None, NOW).expect("again");
    assert!(l1b.list.seq > l1.list.seq);
    assert!(root.apply_revocations(l1b, NOW).expect("newer"));
    assert!(!root.apply_revocations(l1, NOW).expect("older"));
    assert!(root.is_revoked(&x) && root.is_revoked(&y));
}

#[test]
fn documents_dated_in_the_future_are_refused() {
    let (_dir, team_key, _admin, mut root, _) = team_with_admin();
    let (_, member_id) = peer();
    let future = NOW + gpunode_protocol::time::MAX_CLOCK_SKEW_MS + 60_000;
    let cert = root
        .issue(
            member_id,
            Role::Member,
            &Keypair::generate_ed25519(),
            Some(&team_key),
            future,
        )
        .expect("issue");
    let err = root.admit(cert, NOW).expect_err("future");
    assert!(err.to_string().contains("future"), "{err}");
    // A current renewal is not beaten by a far-future one.
    let now_cert = root
        .issue(
            member_id,
            Role::Member,
            &Keypair::generate_ed25519(),
            Some(&team_key),
            NOW,
        )
        .expect("issue");
    assert!(root.admit(now_cert, NOW).expect("valid"));
    assert!(root.is_member(&member_id, NOW));
}

#[test]
fn a_state_saved_before_merged_revocations_still_loads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (me, _) = peer();
    let state = TeamState::create(dir.path(), "lab", &me, NOW).expect("create");
    #[derive(Serialize)]
    struct Old<'a> {
        name: &'a str,
        team: TeamId,
        team_key: &'a [u8],
        own: &'a SignedCertificate,
        members: &'a [SignedCertificate],
        revocations: Option<SignedRevocations>,
        invites: &'a [Invite],
        bootstrap: &'a [String],
        policy: Option<gpunode_protocol::team::SignedPolicy>,
    }
    let old = Old {
        name: &state.name,
        team: state.team,
        team_key: &state.team_key,
        own: &state.own,
        members: &state.members,
        revocations: None,
        invites: &state.invites,
        bootstrap: &state.bootstrap,
        policy: None,
    };
    std::fs::write(team_dir(dir.path()).join("state"), encoding::encode(&old)).expect("write");
    assert_eq!(TeamState::load(dir.path()).expect("load"), Some(state));
}
