use super::*;

/// One sample of every variant, in declaration order. Appending a variant means appending
/// a sample and a snapshot line.
fn samples() -> Vec<(&'static str, Vec<u8>)> {
    let req = |r: HostRequest| encode(&r).expect("encode");
    let rsp = |r: Response| encode(&r).expect("encode");
    vec![
        (
            "req.hello",
            req(HostRequest::Hello(Hello {
                max_version: 1,
                min_version: 1,
                host_nonce: [1; 32],
            })),
        ),
        (
            "req.auth",
            req(HostRequest::Auth(Auth {
                proof: [2; 32],
                unix_time_ns: 5,
                entropy: [3; 32],
            })),
        ),
        ("req.ping", req(HostRequest::Ping)),
        (
            "req.exec",
            req(HostRequest::ExecStart(ExecStart {
                argv: vec!["sh".into()],
                env: vec![("A".into(), "b".into())],
                cwd: Some("d".into()),
                stdin: Some(serde_bytes::ByteBuf::from(vec![0xff])),
                timeout_ms: Some(7),
                request_key: Some("k".into()),
            })),
        ),
        (
            "req.output",
            req(HostRequest::JobOutput(JobOutputRequest {
                job: JobId(9),
                stdout_cursor: 1,
                stderr_cursor: 2,
                max_bytes: 3,
                wait_ms: 4,
            })),
        ),
        ("req.cancel", req(HostRequest::JobCancel(JobId(9)))),
        (
            "req.read",
            req(HostRequest::FileRead(FileRead {
                path: "a".into(),
                offset: 1,
                len: 2,
            })),
        ),
        (
            "req.write",
            req(HostRequest::FileWrite(FileWrite {
                path: "a".into(),
                mode: WriteMode::At(3),
                data: vec![1],
                create_parents: true,
            })),
        ),
        (
            "req.bench",
            req(HostRequest::Bench(BenchRequest::ForkExecWait {
                iterations: 2,
            })),
        ),
        ("req.discard", req(HostRequest::Discard(vec![1, 2]))),
        ("req.source", req(HostRequest::Source(3))),
        ("req.poweroff", req(HostRequest::PowerOff)),
        ("req.joblist", req(HostRequest::JobList)),
        ("req.freeze", req(HostRequest::Freeze)),
        (
            "req.thaw",
            req(HostRequest::Thaw(Thaw {
                unix_time_ns: 7,
                entropy: [6; 32],
            })),
        ),
        (
            "req.read_versioned",
            req(HostRequest::ReadVersioned(ReadVersioned {
                path: "a".into(),
                offset: 1,
                len: 2,
            })),
        ),
        (
            "req.write_checked",
            req(HostRequest::WriteChecked(WriteChecked {
                path: "a".into(),
                data: vec![1],
                precondition: Precondition::IfVersion([7; 32]),
                create_parents: true,
            })),
        ),
        (
            "req.write_checked.create_only",
            req(HostRequest::WriteChecked(WriteChecked {
                path: "a".into(),
                data: vec![],
                precondition: Precondition::CreateOnly,
                create_parents: false,
            })),
        ),
        (
            "req.edit",
            req(HostRequest::Edit(EditFile {
                path: "a".into(),
                old: "o".into(),
                new: "n".into(),
                expected_version: Some([8; 32]),
            })),
        ),
        (
            "req.glob",
            req(HostRequest::Glob(GlobRequest {
                pattern: "*.rs".into(),
                path: Some("d".into()),
                limit: 5,
            })),
        ),
        (
            "req.grep",
            req(HostRequest::Grep(GrepRequest {
                pattern: "x".into(),
                glob: Some("*.rs".into()),
                path: None,
                case_insensitive: true,
                limit: 5,
            })),
        ),
        (
            "req.exec_interactive",
            req(HostRequest::ExecInteractive(ExecInteractive {
                start: ExecStart {
                    argv: vec!["sh".into()],
                    env: vec![("A".into(), "b".into())],
                    cwd: None,
                    stdin: None,
                    timeout_ms: Some(7),
                    request_key: Some("k".into()),
                },
                tty: Some(WindowSize { rows: 24, cols: 80 }),
            })),
        ),
        (
            "req.input",
            req(HostRequest::JobInput(JobInput {
                job: JobId(9),
                data: vec![3],
                eof: true,
            })),
        ),
        (
            "req.resize",
            req(HostRequest::JobResize(JobResize {
                job: JobId(9),
                size: WindowSize {
                    rows: 40,
                    cols: 120,
                },
            })),
        ),
        (
            "rsp.hello",
            rsp(Ok(GuestResponse::Hello(HelloReply {
                version: 1,
                guest_nonce: [4; 32],
                proof: [5; 32],
            }))),
        ),
        (
            "rsp.auth",
            rsp(Ok(GuestResponse::Authenticated(AgentInfo {
                agent_version: "v".into(),
                kernel_release: "k".into(),
                boot_id: "b".into(),
                uptime_ms: 1,
            }))),
        ),
        ("rsp.pong", rsp(Ok(GuestResponse::Pong))),
        ("rsp.exec", rsp(Ok(GuestResponse::ExecStarted(JobId(1))))),
        (
            "rsp.output",
            rsp(Ok(GuestResponse::JobOutput(JobOutput {
                stdout: vec![b'o'],
                stderr: vec![b'e'],
                stdout_retained: 1,
                stderr_retained: 1,
                state: JobState::Finished(JobExit {
                    code: Some(3),
                    signal: None,
                    timed_out: false,
                    cancelled: true,
                }),
                truncated: true,
                output_complete: false,
                background_processes: 2,
            }))),
        ),
        ("rsp.cancel", rsp(Ok(GuestResponse::JobCancelled))),
        (
            "rsp.read",
            rsp(Ok(GuestResponse::FileData(FileData {
                data: vec![7],
                size: 1,
                eof: true,
            }))),
        ),
        (
            "rsp.write",
            rsp(Ok(GuestResponse::FileWritten(FileWritten { size: 2 }))),
        ),
        (
            "rsp.bench",
            rsp(Ok(GuestResponse::Bench(BenchReply {
                samples_ns: vec![1, 2],
            }))),
        ),
        ("rsp.discarded", rsp(Ok(GuestResponse::Discarded))),
        ("rsp.source", rsp(Ok(GuestResponse::Source(vec![0, 0])))),
        ("rsp.poweroff", rsp(Ok(GuestResponse::PoweringOff))),
        ("rsp.frozen", rsp(Ok(GuestResponse::Frozen(2)))),
        ("rsp.thawed", rsp(Ok(GuestResponse::Thawed))),
        (
            "rsp.jobs",
            rsp(Ok(GuestResponse::Jobs(vec![JobSummary {
                id: JobId(3),
                state: JobState::Running,
                command: "python3 -m http.server".into(),
                background_processes: 1,
                processes: vec![ProcessInfo {
                    pid: 42,
                    name: "python3".into(),
                }],
            }]))),
        ),
        ("rsp.input_written", rsp(Ok(GuestResponse::InputWritten))),
        ("rsp.resized", rsp(Ok(GuestResponse::Resized))),
        ("rsp.ca_installed", rsp(Ok(GuestResponse::CaInstalled))),
        (
            "req.rekey",
            req(HostRequest::Rekey(Rekey {
                contribution: [1; 32],
                proof: [2; 32],
                unix_time_ns: 3,
                entropy: [4; 32],
                hostname: "vm-1".into(),
                machine_id: "0123456789abcdef0123456789abcdef".into(),
            })),
        ),
        (
            "rsp.rekeyed",
            rsp(Ok(GuestResponse::Rekeyed(RekeyProof { proof: [5; 32] }))),
        ),
        (
            "req.install_ca",
            req(HostRequest::InstallCa("-----BEGIN CERTIFICATE-----".into())),
        ),
        (
            "rsp.versioned_data",
            rsp(Ok(GuestResponse::VersionedData(VersionedData {
                data: vec![7],
                size: 1,
                eof: true,
                version: Some([9; 32]),
            }))),
        ),
        (
            "rsp.file_versioned",
            rsp(Ok(GuestResponse::FileVersioned(FileVersion {
                version: [9; 32],
                size: 3,
            }))),
        ),
        (
            "rsp.glob",
            rsp(Ok(GuestResponse::Glob(GlobResult {
                paths: vec!["a".into()],
                truncated: true,
            }))),
        ),
        (
            "rsp.grep",
            rsp(Ok(GuestResponse::Grep(GrepResult {
                matches: vec![GrepMatch {
                    path: "a".into(),
                    line: 2,
                    text: "t".into(),
                }],
                truncated: false,
            }))),
        ),
        (
            "rsp.error",
            rsp(Err(GuestError::new(ErrorCode::Internal, "x"))),
        ),
        (
            "rsp.error.conflict",
            rsp(Err(GuestError::new(ErrorCode::Conflict, "x"))),
        ),
        (
            "rsp.error.too_large",
            rsp(Err(GuestError::new(ErrorCode::TooLarge, "x"))),
        ),
        (
            "stream.tcp",
            encode(&crate::stream::StreamTarget::Tcp { port: 5000 }).expect("encode"),
        ),
        (
            "stream.tar_extract",
            encode(&crate::stream::StreamTarget::TarExtract { dir: "/d".into() }).expect("encode"),
        ),
        (
            "stream.tar_create",
            encode(&crate::stream::StreamTarget::TarCreate { path: "/p".into() }).expect("encode"),
        ),
        (
            "req.output_acked",
            req(HostRequest::JobOutputAcked(JobOutputAcked {
                read: JobOutputRequest {
                    job: JobId(9),
                    stdout_cursor: 5,
                    stderr_cursor: 6,
                    max_bytes: 7,
                    wait_ms: 8,
                },
                release_stdout: 1,
                release_stderr: 2,
            })),
        ),
        (
            "req.exec_broker",
            req(HostRequest::ExecBroker(ExecStart {
                argv: vec!["sh".into()],
                env: vec![],
                cwd: None,
                stdin: None,
                timeout_ms: None,
                request_key: Some("k".into()),
            })),
        ),
        (
            "stream.broker_accept",
            encode(&crate::stream::StreamTarget::BrokerAccept { job: JobId(3) }).expect("encode"),
        ),
    ]
}

/// Contract test: the encoding of every message is pinned. If this fails, either revert
/// the change or bump PROTOCOL_VERSION and update `schema.snapshot` deliberately
/// (`WARREN_UPDATE_SNAPSHOT=1 cargo test -p warren-protocol`).
#[test]
fn test_schema_snapshot_unchanged() {
    let rendered: String = samples()
        .into_iter()
        .map(|(name, bytes)| format!("{name} {}\n", hex::encode(bytes)))
        .collect();
    let rendered = format!("version {}\n{rendered}", crate::PROTOCOL_VERSION);
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/schema.snapshot");
    if std::env::var_os("WARREN_UPDATE_SNAPSHOT").is_some() {
        std::fs::write(path, &rendered).expect("write snapshot");
    }
    let expected = std::fs::read_to_string(path).expect("schema.snapshot exists");
    assert_eq!(rendered, expected, "protocol schema changed");
}

#[test]
fn test_decode_roundtrip_request_preserved() {
    let r = HostRequest::FileWrite(FileWrite {
        path: "x/y".into(),
        mode: WriteMode::Append,
        data: vec![0, 255, 1],
        create_parents: false,
    });
    let back: HostRequest = decode(&encode(&r).expect("encode")).expect("decode");
    assert_eq!(back, r);
}

#[test]
fn test_exec_digest_differs_when_any_field_differs() {
    let a = ExecStart {
        argv: vec!["true".into()],
        env: Vec::new(),
        cwd: None,
        stdin: None,
        timeout_ms: None,
        request_key: Some("k".into()),
    };
    let b = ExecStart {
        timeout_ms: Some(1),
        ..a.clone()
    };
    assert_eq!(
        a.digest().expect("digest"),
        a.clone().digest().expect("digest")
    );
    assert_ne!(a.digest().expect("digest"), b.digest().expect("digest"));
}

#[test]
fn test_error_code_conflict_as_str_stable() {
    assert_eq!(ErrorCode::Conflict.as_str(), "conflict");
}

#[test]
fn test_decode_garbage_is_malformed() {
    assert!(matches!(
        decode::<HostRequest>(&[0xff, 0xff, 0xff]),
        Err(CodecError::Malformed(_))
    ));
}

/// A long error answer is told from its first bytes: the code, the message's first bytes
/// (never a cut character) and its length; nothing while too few bytes are there, and
/// nothing for short errors or other answers, however long.
#[test]
fn test_long_error_head_from_the_first_bytes() {
    let message = format!("{}é{}", "E".repeat(99), "x".repeat(512 << 10));
    let wire = encode(&Err::<GuestResponse, _>(GuestError::new(
        ErrorCode::NotFound,
        message.clone(),
    )))
    .expect("encode");
    for short in [0, 1, 2, 3, 4, 5, 50, 100] {
        assert!(long_error_head(&wire[..short], 100).is_none(), "{short}");
    }
    let (code, text, len) = long_error_head(&wire[..200], 100)
        .expect("told")
        .expect("well formed");
    assert_eq!((code, len), (ErrorCode::NotFound, message.len()));
    assert_eq!(text, "E".repeat(99), "the cut 'é' is left out");
    let (_, text, _) = long_error_head(&wire, 101).expect("told").expect("ok");
    assert_eq!(text, format!("{}é", "E".repeat(99)));

    let short = encode(&Err::<GuestResponse, _>(GuestError::new(
        ErrorCode::Io,
        "x".repeat(100),
    )))
    .expect("encode");
    assert!(long_error_head(&short, 100).is_none());
    let ok = encode(&Ok::<_, GuestError>(GuestResponse::Source(vec![
        1;
        512 << 10
    ])))
    .expect("enc");
    assert!(long_error_head(&ok, 100).is_none());

    let mut bad = wire.clone();
    let at = wire.len() - message.len();
    bad[at] = 0xff;
    assert!(matches!(
        long_error_head(&bad, 100),
        Some(Err(CodecError::Malformed(_)))
    ));
}
