//! `Daemon`: a real `warren serve` on an ephemeral loopback port with a private state
//! directory, its config naming the shared test images, plus a minimal HTTP/1.1 client (so
//! tests control every header and byte: bad Hosts, Origins, malformed and oversize bodies).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use super::{TestEnv, WARREN};

/// The id of the image of `recipe` for the current agent (what `image build` returns: a
/// cache hit once `.ci/run` built it), not merely the newest image of that recipe.
pub fn image_id(env: &TestEnv, recipe: &str) -> String {
    let out = env.run(&["image", "build", "--recipe", recipe]);
    assert!(
        out.status.success(),
        "image build: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .expect("image id on stdout")
        .trim()
        .to_string()
}

pub struct Daemon {
    pub env: TestEnv,
    pub config: PathBuf,
    pub addr: String,
    pub socket: PathBuf,
    /// Where the service's stderr goes, at the most verbose logging (`None`: inherited, at
    /// info).
    log: Option<PathBuf>,
    /// Extra environment of the service (and so of its supervisors and VMMs).
    envs: Vec<(String, String)>,
    child: Option<Child>,
}

/// A response: status, parsed JSON body (Null if not JSON), and headers lowercased.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub body: Value,
    pub text: String,
    pub headers: Vec<(String, String)>,
}

impl Resp {
    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("")
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

impl Daemon {
    /// Starts a service; `extra` is appended to the generated TOML (e.g. `[limits]`).
    pub fn start(extra: &str) -> Daemon {
        Self::start_with(extra, None)
    }

    /// Starts a service logging everything it can (`-vv`, `RUST_LOG=trace`) into `log`.
    pub fn start_logging(extra: &str, log: PathBuf) -> Daemon {
        Self::start_with(extra, Some(log))
    }

    /// Starts a service with extra environment variables (`WARREN_ACCEL` among them sets
    /// the config's accelerator).
    pub fn start_env(extra: &str, envs: &[(&str, &str)]) -> Daemon {
        let envs = envs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Self::start_full(extra, None, envs, true)
    }

    /// Starts a service whose only configured image is `minimal` (no `dev` build needed);
    /// `extra` may name it again (`{minimal}` is replaced by its id) under other names.
    pub fn start_minimal(extra: &str) -> Daemon {
        Self::start_full(extra, None, Vec::new(), false)
    }

    /// Starts a service on `env` (its state and image directories) serving exactly the
    /// `[images.*]` tables in `images`.
    pub fn start_in(env: TestEnv, images: &str) -> Daemon {
        let state = env.state.path();
        let accel = std::env::var("WARREN_ACCEL").unwrap_or_else(|_| "auto".into());
        let config = state.join("warren.toml");
        let text = format!(
            "state_dir = {state:?}\nimage_dir = {img:?}\naccel = {accel:?}\nsocket_mode = 0o666\n\
             [http]\nlisten = \"127.0.0.1:0\"\nmax_body_bytes = 262144\n{images}",
            img = env.image_dir,
        );
        std::fs::write(&config, text).expect("write config");
        let mut d = Daemon {
            env,
            config,
            addr: String::new(),
            socket: PathBuf::new(),
            log: None,
            envs: Vec::new(),
            child: None,
        };
        d.spawn();
        d
    }

    fn start_with(extra: &str, log: Option<PathBuf>) -> Daemon {
        Self::start_full(extra, log, Vec::new(), true)
    }

    fn start_full(
        extra: &str,
        log: Option<PathBuf>,
        envs: Vec<(String, String)>,
        with_dev: bool,
    ) -> Daemon {
        let env = TestEnv::new();
        let minimal = image_id(&env, "minimal");
        let extra = extra.replace("{minimal}", &minimal);
        let images = if with_dev {
            format!(
                "[images.minimal]\nid = \"{minimal}\"\ndefault = true\n\
                 [images.dev]\nid = \"{}\"\n",
                image_id(&env, "dev")
            )
        } else {
            format!("[images.minimal]\nid = \"{minimal}\"\ndefault = true\n")
        };
        let state = env.state.path();
        let accel = envs
            .iter()
            .find(|(k, _)| k == "WARREN_ACCEL")
            .map(|(_, v)| v.clone())
            .or_else(|| std::env::var("WARREN_ACCEL").ok())
            .unwrap_or_else(|| "auto".into());
        let config = state.join("warren.toml");
        let text = format!(
            "state_dir = {state:?}\nimage_dir = {img:?}\naccel = {accel:?}\nsocket_mode = 0o666\n\
             [http]\nlisten = \"127.0.0.1:0\"\nmax_body_bytes = 262144\n\
             {extra}\n{images}",
            img = env.image_dir,
        );
        std::fs::write(&config, text).expect("write config");
        let mut d = Daemon {
            env,
            config,
            addr: String::new(),
            socket: PathBuf::new(),
            log,
            envs,
            child: None,
        };
        d.spawn();
        d
    }

    /// (Re)starts the process on the same state directory.
    pub fn spawn(&mut self) {
        let mut cmd = Command::new(WARREN);
        cmd.arg("serve").arg("--config").arg(&self.config);
        cmd.envs(self.envs.iter().map(|(k, v)| (k, v)));
        match &self.log {
            Some(path) => {
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .expect("open the service log");
                cmd.arg("-vv").env("RUST_LOG", "trace").stderr(f);
            }
            None => {
                cmd.env("RUST_LOG", "info").stderr(Stdio::inherit());
            }
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn warren serve");
        let out = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(out)
            .read_line(&mut line)
            .expect("ready line");
        // "warrend: serving http://ADDR/mcp and /v1/tools, local socket PATH"
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|s| s.split('/').next())
            .unwrap_or_else(|| panic!("no ready line from warren serve: {line:?}"));
        self.addr = addr.to_string();
        self.socket = PathBuf::from(
            line.trim_end()
                .rsplit(' ')
                .next()
                .expect("socket path in ready line"),
        );
        self.child = Some(child);
    }

    /// The service process's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops the service as its unit would (SIGTERM), waiting for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = c.wait();
        }
    }

    /// Kills the service abruptly (SIGKILL), as a crash would.
    pub fn crash(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Issues a token with extra `token issue` flags; returns the token text.
    pub fn token(&self, workspace: &str, flags: &[&str]) -> String {
        let file = self
            .env
            .state
            .path()
            .join(format!("{workspace}-{}.token", rand_suffix()));
        let mut args = vec!["token", "issue", "--workspace", workspace, "--output"];
        let f = file.to_str().expect("utf-8 path").to_string();
        args.push(&f);
        args.extend_from_slice(flags);
        let out = self.env.run(&args);
        assert!(
            out.status.success(),
            "token issue: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read_to_string(&file)
            .expect("token file")
            .trim()
            .to_string()
    }

    /// A WebSocket upgrade request's refusal: its status and error code (read by hand: the
    /// shared client adds `Connection: close`, which is no upgrade).
    pub fn upgrade_status(&self, token: Option<&str>, path: &str) -> (u16, String) {
        let mut s = std::net::TcpStream::connect(&self.addr).expect("connect");
        s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
            .ok();
        let auth = token
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
             Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n{auth}\r\n",
            self.addr
        );
        std::io::Write::write_all(&mut s, req.as_bytes()).expect("write");
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = s.read(&mut chunk).unwrap_or(0);
            buf.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&buf).to_string();
            if let Some(end) = text.find("\r\n\r\n") {
                let len = text[..end]
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                    })
                    .unwrap_or(0);
                if buf.len() >= end + 4 + len || n == 0 {
                    let status: u16 = text[9..12].parse().expect("status");
                    let body: serde_json::Value =
                        serde_json::from_slice(&buf[end + 4..]).unwrap_or_default();
                    return (
                        status,
                        body["error"]["code"].as_str().unwrap_or("").to_string(),
                    );
                }
            }
            assert!(
                n > 0,
                "connection closed early: {}",
                String::from_utf8_lossy(&buf)
            );
        }
    }

    pub fn token_file(&self, token: &str) -> PathBuf {
        let p = self.env.state.path().join(format!("t-{}", rand_suffix()));
        std::fs::write(&p, token).expect("write token");
        p
    }

    /// `POST /v1/tools/{tool}` with a bearer token and a JSON body.
    pub fn call(&self, token: &str, tool: &str, args: Value) -> Resp {
        self.post(
            &format!("/v1/tools/{tool}"),
            &[("Authorization", &format!("Bearer {token}"))],
            args.to_string().as_bytes(),
        )
    }

    /// Sends a tool call and returns its connection without reading the answer: dropping it
    /// hangs up on the call (a client cut off).
    pub fn send_only(&self, token: &str, tool: &str, args: Value) -> std::net::TcpStream {
        let mut s = std::net::TcpStream::connect(&self.addr).expect("connect");
        let body = args.to_string();
        let req = format!(
            "POST /v1/tools/{tool} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\
             Authorization: Bearer {token}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            self.addr,
            body.len()
        );
        s.write_all(req.as_bytes()).expect("write request");
        s
    }

    /// Like `call`, panicking unless it succeeds; returns the body.
    pub fn ok(&self, token: &str, tool: &str, args: Value) -> Value {
        let r = self.call(token, tool, args);
        assert_eq!(r.status, 200, "{tool} failed: {}", r.text);
        r.body
    }

    pub fn post(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
        let mut h = vec![("Content-Type", "application/json")];
        h.extend_from_slice(headers);
        self.request("POST", path, &h, body)
    }

    /// A request over TCP with `Host` set to the bound address unless `headers` sets one.
    pub fn request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
        let mut s = std::net::TcpStream::connect(&self.addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(120))).ok();
        let host = if headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
            None
        } else {
            Some(self.addr.clone())
        };
        exchange(&mut s, method, path, host.as_deref(), headers, body)
    }

    /// A request over TCP whose response body may never end (an SSE stream): returns the
    /// status and headers, leaving the body unread (`text` empty), and closes the connection.
    pub fn request_head(&self, method: &str, path: &str, headers: &[(&str, &str)]) -> Resp {
        let mut s = std::net::TcpStream::connect(&self.addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(120))).ok();
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\n", self.addr);
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("Content-Length: 0\r\n\r\n");
        s.write_all(req.as_bytes()).expect("write request");
        let head = read_head(&mut s);
        let mut r = parse_response(&head);
        r.text.clear();
        r
    }

    /// A tool call over the local socket as the calling process (root).
    pub fn local_call(&self, tool: &str, args: Value, headers: &[(&str, &str)]) -> Resp {
        let mut s = std::os::unix::net::UnixStream::connect(&self.socket).expect("connect socket");
        s.set_read_timeout(Some(Duration::from_secs(120))).ok();
        let mut h = vec![("Content-Type", "application/json")];
        h.extend_from_slice(headers);
        exchange(
            &mut s,
            "POST",
            &format!("/v1/tools/{tool}"),
            Some("warrend"),
            &h,
            args.to_string().as_bytes(),
        )
    }

    /// A tool call over the local socket from another uid (curl under setpriv).
    pub fn local_call_as(&self, uid: u32, tool: &str, args: Value) -> Resp {
        let out = Command::new("setpriv")
            .args([
                &format!("--reuid={uid}"),
                &format!("--regid={uid}"),
                "--clear-groups",
                "curl",
                "-sS",
                "-i",
                "--unix-socket",
            ])
            .arg(&self.socket)
            .args(["-H", "Content-Type: application/json", "-d"])
            .arg(args.to_string())
            .arg(format!("http://warrend/v1/tools/{tool}"))
            .output()
            .expect("run setpriv curl");
        assert!(
            out.status.success(),
            "curl as {uid}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        parse_response(&out.stdout)
    }

    /// Every VM of the state directory, through the CLI (all workspaces).
    pub fn all_vms(&self) -> Vec<Value> {
        let out = self.env.run(&["vm", "list", "--json"]);
        assert!(out.status.success(), "vm list");
        let v: Value = serde_json::from_slice(&out.stdout).expect("json");
        v.as_array().cloned().unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // A graceful stop leaves VMs running: destroy them through the CLI afterwards.
        self.stop();
        for vm in self.all_vms() {
            if let Some(id) = vm["id"].as_str() {
                if std::thread::panicking() {
                    super::print_vm_logs(&self.env, id);
                }
                let _ = self.env.run(&["vm", "destroy", id]);
            }
        }
    }
}

fn rand_suffix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn exchange(
    s: &mut (impl Read + Write),
    method: &str,
    path: &str,
    host: Option<&str>,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if let Some(h) = host {
        req.push_str(&format!("Host: {h}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    s.write_all(req.as_bytes()).expect("write request");
    // The server may answer (413) before reading a large body; ignore a reset while writing.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse_response(&raw)
}

/// Reads a response head byte by byte, up to and including its blank line (or EOF), leaving
/// the body unread.
pub fn read_head(s: &mut impl Read) -> Vec<u8> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    head
}

pub fn parse_response(raw: &[u8]) -> Resp {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP response: {text:?}"));
    let mut lines = head.lines();
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad status line: {head:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    Resp {
        status,
        body: serde_json::from_str(&body).unwrap_or(Value::Null),
        text: body,
        headers,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// Waits for a job through `vm_job_output`, following cursors; returns (stdout, last page).
pub fn wait_job(d: &Daemon, token: &str, vm: &str, job: &str) -> (String, Value) {
    let mut cursor = json!({"stdout": 0, "stderr": 0});
    let mut out = String::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let p = d.ok(
            token,
            "vm_job_output",
            json!({"vm_id": vm, "job_id": job, "cursor": cursor, "wait_ms": 2000}),
        );
        out.push_str(p["stdout"].as_str().unwrap_or(""));
        let done = p["state"] == "completed" && p["next_cursor"] == cursor;
        cursor = p["next_cursor"].clone();
        if done {
            return (out, p);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "job {job} never completed"
        );
    }
}
