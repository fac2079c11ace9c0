//! `warren systemd-generator`: keeps `warren.socket`'s addresses those of the configuration.
//!
//! The packaged `warren.socket` binds the service's HTTP port (socket activation), and the
//! service serves the sockets it is passed only when they are exactly what `listen` in
//! `/etc/warren/warren.toml` asks for (`warren_api::activation`). An operator who changed
//! `listen` (or upgraded from a version without the socket unit, with a `listen` of their own)
//! would otherwise have to repeat it in the socket unit, and until then the service would not
//! start. systemd runs every program in `/usr/lib/systemd/system-generators/` at boot and on
//! each `daemon-reload`, before it loads units; the package's `warren-socket-generator` runs
//! this, which writes a drop-in for `warren.socket` into the generator's normal directory
//! (`/run/systemd/generator/warren.socket.d/00-warren-listen.conf`) with the addresses for `listen`.
//! systemd applies drop-ins in the order of their file names, whatever their directory: one
//! of the operator's in `/etc/systemd/system/warren.socket.d/` named to sort after it comes
//! later and wins (the service still refuses addresses that are not `listen`'s). The
//! configuration read is `/etc/warren/warren.toml`, the one `warren.service` names.
//!
//! No configuration file: nothing is written (the unit's own addresses, the default `listen`,
//! stay), and a line says so (systemd logs a generator's standard error). A configuration that does not parse: nothing is written and the generator fails
//! with the reason (systemd logs it); the service refuses the same file when it starts.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

/// The drop-in's name inside `warren.socket.d/`.
/// `00-`: an operator's own drop-in (`override.conf` from `systemctl edit`, `10-*.conf`)
/// sorts after it, across directories, and so comes after its `ListenStream=` reset.
const DROP_IN: &str = "00-warren-listen.conf";

/// Runs the generator: `normal_dir` is the first directory systemd passes.
pub fn run(config: &Path, normal_dir: &Path) -> Result<i32> {
    let listen = match warren_api::config::load_listen(config) {
        Ok(listen) => listen,
        Err(warren_api::config::ConfigError::Read { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            eprintln!(
                "warren-socket-generator: {} does not exist; warren.socket keeps its own \
                 addresses",
                config.display()
            );
            return Ok(0);
        }
        Err(e) => return Err(e.into()),
    };
    let addrs = warren_api::activation::unit_addresses(listen)?;
    let mut text = format!(
        "# Written by warren-socket-generator from {} (listen = \"{listen}\") at boot and on\n\
         # each daemon-reload: the addresses the service serves for it.\n[Socket]\nListenStream=\n",
        config.display()
    );
    for addr in &addrs {
        // `%` starts a unit file specifier; a scoped IPv6 address has one (`fe80::1%2`).
        let addr = addr.to_string().replace('%', "%%");
        text.push_str(&format!("ListenStream={addr}\n"));
    }
    write_drop_in(normal_dir, &text)?;
    Ok(0)
}

/// Writes `warren.socket.d/00-warren-listen.conf` under `dir` whole or not at all (a temporary
/// file renamed over it).
fn write_drop_in(dir: &Path, text: &str) -> Result<()> {
    let d = dir.join("warren.socket.d");
    std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".00-warren-listen.")
        .tempfile_in(&d)
        .with_context(|| format!("creating a file in {}", d.display()))?;
    tmp.write_all(text.as_bytes())
        .and_then(|()| tmp.as_file().sync_all())
        .with_context(|| format!("writing in {}", d.display()))?;
    let perms = std::os::unix::fs::PermissionsExt::from_mode(0o644);
    tmp.as_file()
        .set_permissions(perms)
        .with_context(|| format!("writing in {}", d.display()))?;
    tmp.persist(d.join(DROP_IN))
        .with_context(|| format!("writing {}", d.join(DROP_IN).display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_the_drop_in_names_the_addresses_of_listen_and_nothing_without_a_config() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("normal");
        assert_eq!(run(&dir.path().join("missing.toml"), &out).expect("run"), 0);
        assert!(!out.exists());

        let config = dir.path().join("warren.toml");
        // The drop-in written into `to` for a configuration file of `text`.
        let drop_in = |text: &str, to: &Path| {
            std::fs::write(&config, text).expect("write");
            assert_eq!(run(&config, to).expect("run"), 0);
            std::fs::read_to_string(to.join("warren.socket.d").join(DROP_IN)).expect("drop-in")
        };
        let text = drop_in("[http]\nlisten = \"127.0.0.1:18123\"\n", &out);
        let lines: Vec<_> = text.lines().filter(|l| !l.starts_with('#')).collect();
        let mut want = vec!["[Socket]", "ListenStream=", "ListenStream=127.0.0.1:18123"];
        if std::path::Path::new("/proc/net/if_inet6").exists() {
            want.push("ListenStream=[::1]:18123");
        }
        assert_eq!(lines, want);
        // The package's file before it is configured (its placeholder image) names the port.
        let placeholder = drop_in(
            "state_dir = \"/var/lib/warren\"\n[images.dev]\nid = \"REPLACE\"\n",
            &out,
        );
        assert!(
            placeholder.contains("\nListenStream=127.0.0.1:8090\n"),
            "{placeholder}"
        );
        let text = drop_in("[http]\nlisten = \"127.0.0.1:18123\"\n", &out);

        // A scoped address's `%` is written as a unit file's literal percent sign, and an
        // IPv4-mapped address as the IPv4 address (the unit's sockets are IPv6-only).
        let other = dir.path().join("other");
        let scoped = drop_in("[http]\nlisten = \"[fe80::1%2]:18123\"\n", &other);
        assert!(
            scoped.contains("\nListenStream=[fe80::1%%2]:18123\n"),
            "{scoped}"
        );
        let mapped = drop_in("[http]\nlisten = \"[::ffff:127.0.0.1]:18123\"\n", &other);
        assert!(
            mapped.contains("\nListenStream=127.0.0.1:18123\n"),
            "{mapped}"
        );

        std::fs::write(&config, "[http]\nlisten = \"nonsense\"\n").expect("write");
        assert!(run(&config, &out).is_err());
        // The earlier drop-in stays whole.
        assert_eq!(
            std::fs::read_to_string(out.join("warren.socket.d").join(DROP_IN)).expect("read"),
            text
        );
    }
}
