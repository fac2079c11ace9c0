//! Real-VM tests of interactive jobs: `warren vm exec --tty` on a local pseudo-terminal that
//! this test drives like a user (typed bytes, Ctrl-C, window resizes), and `-i` (streamed
//! stdin without a terminal). One VM is booted and shared by every case, in order.

mod common;

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use rustix::pty::OpenptFlags;
use rustix::termios::Winsize;

/// `warren` running on a fresh local pseudo-terminal as its controlling terminal.
struct Terminal {
    master: Arc<OwnedFd>,
    child: Child,
    output: Arc<Mutex<Vec<u8>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

fn winsize(rows: u16, cols: u16) -> Winsize {
    Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

impl Terminal {
    /// Runs `warren <args>` in a new session whose controlling terminal is a new
    /// pseudo-terminal of `rows` x `cols` (util-linux `setsid --ctty`).
    fn spawn(vm: &TestVm, args: &[&str], rows: u16, cols: u16) -> Terminal {
        let flags = OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC;
        let master = rustix::pty::openpt(flags).expect("openpt");
        rustix::pty::grantpt(&master).expect("grantpt");
        rustix::pty::unlockpt(&master).expect("unlockpt");
        let slave = rustix::pty::ioctl_tiocgptpeer(&master, flags).expect("slave");
        rustix::termios::tcsetwinsize(&master, winsize(rows, cols)).expect("winsize");
        let mut cmd = Command::new("setsid");
        cmd.args(["--ctty", "--wait"]).arg(WARREN);
        cmd.arg("--state-dir")
            .arg(vm.env.state.path())
            .arg("--image-dir")
            .arg(&vm.env.image_dir)
            .args(args)
            .env("TERM", "xterm-test")
            .stdin(Stdio::from(slave.try_clone().expect("dup")))
            .stdout(Stdio::from(slave.try_clone().expect("dup")))
            .stderr(Stdio::from(slave));
        let child = cmd.spawn().expect("spawn setsid warren");
        let master = Arc::new(master);
        let output = Arc::new(Mutex::new(Vec::new()));
        let reader = {
            let (master, output) = (master.clone(), output.clone());
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                // EIO once warren (the last holder of the slave) has exited.
                while let Ok(n) = rustix::io::read(master.as_fd(), &mut buf) {
                    if n == 0 {
                        break;
                    }
                    output.lock().expect("output").extend_from_slice(&buf[..n]);
                }
            })
        };
        Terminal {
            master,
            child,
            output,
            reader: Some(reader),
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().expect("output")).into_owned()
    }

    /// Waits until the terminal showed `needle`.
    fn expect(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.text().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "terminal never showed {needle:?}; it shows {:?}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Types `bytes` on the terminal's keyboard.
    fn type_bytes(&self, bytes: &[u8]) {
        let mut rest = bytes;
        while !rest.is_empty() {
            let n = rustix::io::write(self.master.as_fd(), rest).expect("write to terminal");
            rest = &rest[n..];
        }
    }

    /// Changes the window size (the kernel signals SIGWINCH to warren).
    fn resize(&self, rows: u16, cols: u16) {
        rustix::termios::tcsetwinsize(self.master.as_fd(), winsize(rows, cols)).expect("resize");
    }

    /// Waits for warren's exit; returns its code and everything the terminal showed.
    fn finish(mut self) -> (i32, String) {
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("wait") {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "warren did not exit; terminal: {:?}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        (status.code().unwrap_or(-1), self.text())
    }
}

/// Is the local terminal in canonical mode with echo (not raw)?
fn terminal_is_canonical(t: &Terminal) -> bool {
    // The master shares the slave's settings.
    let attrs = rustix::termios::tcgetattr(t.master.as_fd()).expect("attrs");
    attrs
        .local_modes
        .contains(rustix::termios::LocalModes::ICANON | rustix::termios::LocalModes::ECHO)
}

fn tty(vm: &TestVm, argv: &[&str], rows: u16, cols: u16) -> Terminal {
    let mut args = vec!["vm", "exec", "--tty", vm.id.as_str(), "--"];
    args.extend_from_slice(argv);
    Terminal::spawn(vm, &args, rows, cols)
}

#[test]
fn test_pty_interactive_sessions() {
    let vm = TestVm::boot();

    // A terminal job sees a terminal of the local size and TERM, and its exit code is ours.
    let t = tty(
        &vm,
        &["sh", "-c", "tty; stty size; echo TERM=$TERM; exit 7"],
        33,
        101,
    );
    let (code, shown) = t.finish();
    assert_eq!(code, 7, "terminal: {shown:?}");
    assert!(shown.contains("/dev/pts/"), "{shown:?}");
    assert!(shown.contains("33 101\r\n"), "{shown:?}");
    assert!(shown.contains("TERM=xterm-test\r\n"), "{shown:?}");

    // Typed input reaches a reading program (echoed by the guest's terminal), and warren
    // puts the local terminal back as it found it.
    let t = tty(
        &vm,
        &["sh", "-c", "echo ready; read x; echo got:$x"],
        24,
        80,
    );
    t.expect("ready");
    assert!(!terminal_is_canonical(&t), "the local terminal is raw");
    t.type_bytes(b"hello\n");
    t.expect("got:hello");
    let master = t.master.clone();
    let (code, shown) = t.finish();
    assert_eq!(code, 0, "{shown:?}");
    assert!(shown.contains("hello\r\ngot:hello\r\n"), "{shown:?}");
    let attrs = rustix::termios::tcgetattr(master.as_fd()).expect("attrs");
    assert!(
        attrs
            .local_modes
            .contains(rustix::termios::LocalModes::ICANON | rustix::termios::LocalModes::ECHO),
        "terminal settings restored"
    );

    // A window resize reaches the guest's terminal.
    let t = tty(
        &vm,
        &[
            "sh",
            "-c",
            "stty size; echo ready; while [ \"$(stty size)\" != '40 120' ]; do sleep 0.1; done; echo resized",
        ],
        24,
        80,
    );
    t.expect("ready");
    t.resize(40, 120);
    t.expect("resized");
    let (code, shown) = t.finish();
    assert_eq!(code, 0, "{shown:?}");
    assert!(shown.starts_with("24 80\r\n"), "{shown:?}");

    // Ctrl-C is delivered as a key: SIGINT to the foreground job, exit code 130.
    let started = Instant::now();
    let t = tty(&vm, &["sh", "-c", "echo ready; exec sleep 100"], 24, 80);
    t.expect("ready");
    t.type_bytes(&[0x03]);
    let (code, shown) = t.finish();
    assert_eq!(code, 130, "{shown:?}");
    assert!(started.elapsed() < Duration::from_secs(60));

    // ... through the guest's terminal, not by cancelling the job: the shell's trap runs.
    let t = tty(
        &vm,
        &[
            "sh",
            "-c",
            "trap 'echo caught-int; exit 42' INT; echo ready; while :; do sleep 1; done",
        ],
        24,
        80,
    );
    t.expect("ready");
    t.type_bytes(&[0x03]);
    let (code, shown) = t.finish();
    assert_eq!(code, 42, "{shown:?}");
    assert!(shown.contains("caught-int"), "{shown:?}");

    // SIGTERM to warren cancels the job, restores the terminal and exits 128+15.
    let t = tty(&vm, &["sh", "-c", "echo ready; exec sleep 100"], 24, 80);
    t.expect("ready");
    assert!(!terminal_is_canonical(&t), "the local terminal is raw");
    let pid = rustix::process::Pid::from_raw(t.child.id() as i32).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("kill");
    let master = t.master.clone();
    let (code, shown) = t.finish();
    assert_eq!(code, 128 + 15, "{shown:?}");
    let attrs = rustix::termios::tcgetattr(master.as_fd()).expect("attrs");
    assert!(
        attrs
            .local_modes
            .contains(rustix::termios::LocalModes::ICANON),
        "terminal settings restored after SIGTERM"
    );

    // Keystroke echo latency through the guest's terminal (reported, loosely bounded).
    let t = tty(&vm, &["sh", "-c", "echo ready; cat"], 24, 80);
    t.expect("ready");
    let mut samples = Vec::new();
    for i in 0..10 {
        let key = [b'a' + i];
        let before = t.text().len();
        let typed = Instant::now();
        t.type_bytes(&key);
        while !t.text()[before..].contains(key[0] as char) {
            assert!(typed.elapsed() < Duration::from_secs(10), "no echo");
            std::thread::sleep(Duration::from_millis(1));
        }
        samples.push(typed.elapsed());
    }
    samples.sort();
    eprintln!(
        "keystroke echo latency: min {:?} median {:?} max {:?}",
        samples[0], samples[5], samples[9]
    );
    assert!(samples[5] < Duration::from_secs(2));
    // The first Ctrl-D hands the pending line to cat, the second is end of file.
    t.type_bytes(&[0x04]);
    t.expect("abcdefghijabcdefghij");
    t.type_bytes(&[0x04]);
    let (code, shown) = t.finish();
    assert_eq!(code, 0, "Ctrl-D ends cat: {shown:?}");

    // Without a terminal: -i streams stdin (end of file closes the job's stdin), stdout and
    // stderr stay separate, the exit code is propagated.
    let mut child = vm
        .env
        .cmd()
        .args(["vm", "exec", "-i", &vm.id, "--"])
        .args(["sh", "-c", "read x; echo out:$x; cat; echo err >&2; exit 3"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(b"hello\n").expect("write");
    stdin.flush().expect("flush");
    std::thread::sleep(Duration::from_millis(300));
    stdin.write_all(b"more\n").expect("write");
    drop(stdin);
    let out = child.wait_with_output().expect("wait");
    assert_eq!(
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).as_ref(),
            String::from_utf8_lossy(&out.stderr).as_ref()
        ),
        (Some(3), "out:hello\nmore\n", "err\n")
    );
}
