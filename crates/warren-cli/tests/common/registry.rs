//! A real OCI registry on loopback (Debian's `docker-registry`, started by the test on a
//! private port and storage directory), OCI layouts made with Debian's `umoci` or by the
//! Python helper (`tests/oci_helper.py`), pushed with Debian's `skopeo`, and an image store
//! of the test's own holding (hard links of) the shared `minimal` image and its kernel stage.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const HELPER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/oci_helper.py");

/// Runs the Python helper; panics unless it succeeds; returns stdout.
pub fn helper(args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(HELPER)
        .args(args)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "oci_helper {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A `docker-registry` serving a private storage directory on 127.0.0.1.
pub struct Registry {
    pub dir: tempfile::TempDir,
    pub port: u16,
    pub child: Arc<Mutex<Option<Child>>>,
}

impl Registry {
    pub fn start() -> Registry {
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("tempdir");
            let port = free_port();
            let config = dir.path().join("config.yml");
            std::fs::write(
                &config,
                format!(
                    "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
                    dir.path().join("store").display()
                ),
            )
            .expect("config");
            let child = Command::new("docker-registry")
                .arg("serve")
                .arg(&config)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("docker-registry (apt install docker-registry)");
            let reg = Registry {
                dir,
                port,
                child: Arc::new(Mutex::new(Some(child))),
            };
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline && reg.alive() {
                if get(port, "/v2/")
                    .is_some_and(|r| r.lines().next().is_some_and(|l| l.contains(" 200 ")))
                {
                    return reg;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            // Not up (the port was taken in between?): try another port.
            reg.stop();
        }
        panic!("docker-registry did not start");
    }

    fn alive(&self) -> bool {
        let mut c = self.child.lock().unwrap_or_else(|e| e.into_inner());
        c.as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// Stops the registry process.
    pub fn stop(&self) {
        if let Some(mut c) = self.child.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Pushes the OCI layout `layout:tag` to `repo:tag` with skopeo; returns the pushed
    /// manifest's digest.
    pub fn push(&self, layout: &Path, tag: &str, repo: &str) -> String {
        let digest_file = layout.with_extension("digest");
        let out = Command::new("skopeo")
            .args(["copy", "--quiet", "--dest-tls-verify=false", "--digestfile"])
            .arg(&digest_file)
            .arg(format!("oci:{}:{tag}", layout.display()))
            .arg(format!("docker://{}/{repo}:{tag}", self.addr()))
            .output()
            .expect("skopeo (apt install skopeo)");
        assert!(
            out.status.success(),
            "skopeo copy: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read_to_string(&digest_file)
            .expect("digest file")
            .trim()
            .to_string()
    }

    /// The file the registry keeps a blob's bytes in.
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").expect("sha256");
        self.dir
            .path()
            .join("store/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A raw HTTP/1.0 GET to 127.0.0.1:port; the response text, if any.
fn get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// Flips one byte in the middle of `file` (same length: the registry's own records of the
/// blob's size stay right, only the content changes).
pub fn flip_byte(file: &Path) {
    let mut b = std::fs::read(file).expect("read blob");
    let i = b.len() / 2;
    b[i] ^= 0x20;
    std::fs::write(file, b).expect("write blob");
}

/// A registry stand-in on loopback that answers every manifest request with `body`
/// (whatever digest was asked for) and `/v2/` with 200: a registry serving a tampered
/// manifest. Returns its port; it serves until the test process ends.
pub fn tampering_registry(body: Vec<u8>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { break };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && head.len() < 65536 {
                match conn.read(&mut byte) {
                    Ok(1) => head.push(byte[0]),
                    _ => break,
                }
            }
            let head = String::from_utf8_lossy(&head);
            let path = head.split_whitespace().nth(1).unwrap_or("");
            let (status, body): (&str, &[u8]) = if path.contains("/manifests/") {
                ("200 OK", &body)
            } else if path == "/v2/" {
                ("200 OK", b"{}")
            } else {
                ("404 Not Found", b"{}")
            };
            let _ = write!(
                conn,
                "HTTP/1.1 {status}\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = conn.write_all(body);
        }
    });
    port
}

/// A TCP proxy in front of `target` that, once it has relayed `after` bytes towards the
/// client, calls `cut` and drops every connection: a registry that stops mid-pull, at a
/// byte count rather than a moment.
pub struct CuttingProxy {
    pub port: u16,
    pub relayed: Arc<AtomicU64>,
    pub cut: Arc<AtomicBool>,
}

impl CuttingProxy {
    pub fn start(target: u16, after: u64, cut: impl Fn() + Send + Sync + 'static) -> CuttingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let relayed = Arc::new(AtomicU64::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let cut = Arc::new(cut);
        let (r2, d2) = (relayed.clone(), done.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { break };
                if d2.load(Ordering::SeqCst) {
                    continue;
                }
                let Ok(upstream) = TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                let (c2, u2) = (
                    client.try_clone().expect("clone"),
                    upstream.try_clone().expect("clone"),
                );
                // client -> registry
                std::thread::spawn(move || {
                    let (mut c, mut u) = (c2, u2);
                    let _ = std::io::copy(&mut c, &mut u);
                    let _ = u.shutdown(std::net::Shutdown::Write);
                });
                // registry -> client, counted
                let (r3, d3, cut) = (r2.clone(), d2.clone(), cut.clone());
                std::thread::spawn(move || {
                    let (mut u, mut c) = (upstream, client);
                    let mut buf = [0u8; 16384];
                    loop {
                        let n = match u.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if c.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        if r3.fetch_add(n as u64, Ordering::SeqCst) + n as u64 >= after
                            && !d3.swap(true, Ordering::SeqCst)
                        {
                            cut();
                            break;
                        }
                        if d3.load(Ordering::SeqCst) {
                            break;
                        }
                    }
                    let _ = c.shutdown(std::net::Shutdown::Both);
                    let _ = u.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        CuttingProxy {
            port,
            relayed,
            cut: done,
        }
    }
}

/// An image store of the test's own: the shared `minimal` image and its kernel stage, hard
/// linked (copied across file systems), so signatures, policies and pulled images stay in
/// the test. Returns the store's directory and the minimal image's id.
pub fn private_store(parent: &Path) -> (PathBuf, String) {
    let minimal = super::image_id("minimal");
    let shared = super::image_dir();
    let store = parent.join("images");
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(shared.join(&minimal).join("manifest.json")).expect("manifest"),
    )
    .expect("json");
    let stage = manifest["stage_digest"].as_str().expect("stage digest");
    for (from, to) in [
        (shared.join(&minimal), store.join(&minimal)),
        (
            shared.join("cache/stages").join(stage),
            store.join("cache/stages").join(stage),
        ),
    ] {
        link_tree(&from, &to);
    }
    for d in ["cache/builds", "cache/downloads"] {
        std::fs::create_dir_all(store.join(d)).expect("mkdir");
    }
    (store, minimal)
}

fn link_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    for e in std::fs::read_dir(from).expect("read dir").flatten() {
        let (src, dst) = (e.path(), to.join(e.file_name()));
        let ft = e.file_type().expect("type");
        if ft.is_dir() {
            link_tree(&src, &dst);
        } else if ft.is_file() && std::fs::hard_link(&src, &dst).is_err() {
            let st = Command::new("cp")
                .args(["--sparse=always", "--preserve=mode"])
                .arg(&src)
                .arg(&dst)
                .status()
                .expect("cp");
            assert!(st.success(), "copy {}", src.display());
        }
    }
}

/// An OCI layout (tag `min`) of the `minimal` image's root file system, made with umoci,
/// with `Env` and `WorkingDir` in its config. Returns the layout's path.
pub fn minimal_layout(dir: &Path, image_dir: &Path, minimal: &str) -> PathBuf {
    let tree = dir.join("tree");
    std::fs::create_dir_all(&tree).expect("mkdir");
    let rootfs = image_dir.join(minimal).join("rootfs.ext4");
    run(Command::new("debugfs")
        .arg("-R")
        .arg(format!("rdump / {}", tree.display()))
        .arg(&rootfs));
    let layout = dir.join("layout");
    let l = layout.display().to_string();
    run(Command::new("umoci").args(["init", "--layout", &l]));
    run(Command::new("umoci").args(["new", "--image", &format!("{l}:min")]));
    run(Command::new("umoci")
        .args(["insert", "--image", &format!("{l}:min")])
        .arg(&tree)
        .arg("/"));
    run(Command::new("umoci").args([
        "config",
        "--image",
        &format!("{l}:min"),
        "--config.env",
        "WARREN_TEST_IMAGE_ENV=from-the-oci-config",
        "--config.workingdir",
        "/srv",
    ]));
    let _ = std::fs::remove_dir_all(&tree);
    layout
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("spawn");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}
