use super::*;

#[test]
fn test_session_names_validated() {
    assert!(valid_name("proj-2"));
    assert!(valid_name("a.b_c"));
    assert!(!valid_name(""));
    assert!(!valid_name("-x"));
    assert!(!valid_name(".x"));
    assert!(!valid_name("a/b"));
    assert!(!valid_name(&"x".repeat(65)));
}

#[test]
fn test_device_differences_only_for_requested_values() {
    let have = SessionDevices {
        image: Some("dev".into()),
        memory_mib: Some(512),
        vcpus: None,
        mounts: vec![],
        network: None,
        source_identity: None,
        objects_identity: None,
        storage_mib: None,
        template: false,
    };
    assert!(have.differences(&SessionDevices::default()).is_empty());
    // Templates are no device: asking for them differs from nothing, and sticks.
    let templated = SessionDevices {
        template: true,
        ..Default::default()
    };
    assert!(have.differences(&templated).is_empty());
    assert!(merge_devices(&have, &templated).template);
    let networked = SessionDevices {
        network: Some(crate::vm::NetworkRequest::default()),
        ..Default::default()
    };
    assert_eq!(
        have.differences(&networked).len(),
        1,
        "network asked, none there"
    );
    assert!(merge_devices(&have, &networked).network.is_some());
    let want = SessionDevices {
        memory_mib: Some(1024),
        ..Default::default()
    };
    assert_eq!(have.differences(&want).len(), 1);
    let m = merge_devices(&have, &want);
    assert_eq!(m.memory_mib, Some(1024));
    assert_eq!(m.image.as_deref(), Some("dev"));
}

#[test]
fn test_session_error_source_refusals_are_invalid_argument() {
    use warren_session::SessionError as S;
    let unsafe_source = session_error(S::UnsafeSource {
        path: "/r/.git/objects".into(),
        reason: "is a symlink".into(),
    });
    assert_eq!(unsafe_source.code(), "invalid_argument");
    assert!(
        unsafe_source
            .to_string()
            .contains("source repository refused: /r/.git/objects"),
        "{unsafe_source}"
    );
    let alternates = session_error(S::SourceHasAlternates("/r/.git/objects".into()));
    assert_eq!(alternates.code(), "invalid_argument");
}

/// A source path the owner may not read is the caller's refusal (`forbidden`), naming the
/// path; any other copy failure stays the host's (`internal`).
#[test]
fn test_session_error_unreadable_source_is_forbidden() {
    use warren_session::SessionError as S;
    let e = session_error(S::Unreadable {
        op: "open",
        path: "/r/secret.txt".into(),
    });
    assert_eq!(e.code(), "forbidden");
    assert!(e.to_string().contains("open /r/secret.txt"), "{e}");
    let io = session_error(S::Io {
        op: "create",
        path: "/state/s/x".into(),
        source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
    });
    assert_eq!(io.code(), "internal");
}

fn limit(mib: Option<u64>) -> Limits {
    Limits {
        max_storage_mib: mib,
        ..Limits::default()
    }
}

#[test]
fn test_session_storage_default_only_under_a_limit_never_for_direct() {
    let none = (Limits::default(), Limits::default());
    assert_eq!(session_storage(false, None, none).expect("plain"), None);
    for limits in [
        (limit(Some(64 << 10)), Limits::default()),
        (Limits::default(), limit(Some(8192))),
    ] {
        assert_eq!(
            session_storage(false, None, limits).expect("default"),
            Some(DEFAULT_SESSION_STORAGE_MIB),
            "a limit applies, so the copy is never unbounded"
        );
    }
    assert_eq!(
        session_storage(false, Some(256), none).expect("asked"),
        Some(256)
    );
    assert_eq!(
        session_storage(true, None, (limit(Some(1)), limit(Some(1)))).expect("direct"),
        None
    );
    for (direct, asked) in [
        (true, 256),
        (false, 63),
        (false, MAX_SESSION_STORAGE_MIB + 1),
    ] {
        let e = session_storage(direct, Some(asked), none).expect_err("refused");
        assert_eq!(e.code(), "invalid_argument", "{e}");
    }
}

#[test]
fn test_check_storage_counts_vm_disks_and_sessions_against_both_limits() {
    use crate::store::Store;
    let d = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&d.path().join("db")).expect("open");
    let mut vm = crate::admission::tests::rec("vm-a", "w", 512);
    vm.state = VmState::Running;
    vm.disk_mib = 1000;
    store
        .insert(&mut vm, 1, |_| Ok::<(), rusqlite::Error>(()))
        .expect("vm");
    let ses = |id: &str, ws: &str, mib: u64| crate::store::tests::session(id, id, ws, mib);
    let admit = |s: SessionRecord, limits| {
        store.insert_session(&s, |tx| -> Result<(), CoreError> {
            check_storage(tx, &s.workspace, s.storage_mib, limits)
        })
    };
    // Workspace w: 1000 (VM disk) + 256 fits 1256 exactly; another 256 does not.
    let ws = (Limits::default(), limit(Some(1256)));
    admit(ses("ses-1", "w", 256), ws).expect("at the limit");
    let e = admit(ses("ses-2", "w", 256), ws).expect_err("past it");
    assert_eq!(e.code(), "quota_exceeded", "{e}");
    assert!(
        e.to_string()
            .contains("workspace w limit of 1256 MiB of storage"),
        "{e}"
    );
    assert!(e.to_string().contains("1256 in use, 256 requested"), "{e}");
    // Another workspace's session is not w's, but it is the host's.
    let host = (limit(Some(2000)), Limits::default());
    admit(ses("ses-3", "other", 700), host).expect("host: 1256 + 700");
    let e = admit(ses("ses-4", "other", 64), host).expect_err("host full");
    assert!(e.to_string().contains("host limit of 2000"), "{e}");
    // What the host has in use is every workspace's, not told to this one.
    assert!(!e.to_string().contains("in use"), "{e}");
    // A refusal left no row; the VM and memory limits do not apply to storage.
    assert_eq!(store.sessions(None).expect("list").len(), 2);
    let vms_full = (
        Limits {
            max_vms: Some(1),
            max_memory_mib: Some(1),
            ..Limits::default()
        },
        Limits::default(),
    );
    admit(ses("ses-5", "w", 64), vms_full).expect("storage only");
}
