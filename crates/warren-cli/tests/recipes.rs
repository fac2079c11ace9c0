//! A recipe file on a real build and a real guest: a Debian package it adds is used by a
//! guest command, a pinned Python wheel (from the Python package index, checked on the host)
//! is importable, a file it copies in arrives with its content and mode, and its commands
//! ran chrooted with only `/proc` and a minimal `/dev`, without network. The image is cached
//! by recipe digest in the shared test image store like the built-in recipes.

mod common;

use common::{TestEnv, TestVm};

const RECIPE: &str = r#"
name = "test-recipe-file"
base = "minimal"
packages = ["tree", "python3-pip"]
commands = [
  "ls /dev | tr '\n' ' ' > /opt/dev-seen",
  "grep -c : /proc/net/dev > /opt/net-interfaces",
  "tree --version > /opt/tree-at-build",
]

[[python]]
name = "six"
version = "1.17.0"
sha256 = "4721f391ed90541fddacab5acf947aa0d3dc7d27b2e1e8eda2be8970586c3274"

[[files]]
source = "greet.sh"
dest = "/usr/local/bin/warren-greet"
mode = 0o755
"#;

#[test]
fn test_recipe_file_package_file_and_commands_reach_the_guest() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("greet.sh"),
        "#!/bin/sh\necho hello from the recipe file\n",
    )
    .expect("write");
    let recipe = dir.path().join("recipe.toml");
    std::fs::write(&recipe, RECIPE).expect("write");
    let env = TestEnv::new();
    let started = std::time::Instant::now();
    let out = env.run(&[
        "image",
        "build",
        "--recipe-file",
        recipe.to_str().expect("utf-8"),
    ]);
    eprintln!(
        "recipe file build: {:.1?}\n{}",
        started.elapsed(),
        String::from_utf8_lossy(&out.stderr)
    );
    let id = common::ok(out, "build").trim().to_string();
    assert_eq!(id.len(), 64);

    // An unknown key is refused before anything is built.
    std::fs::write(
        dir.path().join("bad.toml"),
        format!("{RECIPE}\nbogus = 1\n"),
    )
    .expect("write");
    let bad = dir.path().join("bad.toml");
    let out = env.run(&[
        "image",
        "build",
        "--recipe-file",
        bad.to_str().expect("utf-8"),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field `bogus`"));

    let vm_id = env.create_vm(&id);
    let vm = TestVm::adopt(env, vm_id);
    let run = vm.sh(
        "tree -a /usr/local/bin | head -1; stat -c '%a %U' /usr/local/bin/warren-greet; \
         warren-greet; cat /opt/dev-seen; echo; cat /opt/net-interfaces; \
         python3 -c 'import six; print(six.__version__)'",
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(lines[0], "/usr/local/bin", "{}", run.stdout);
    assert_eq!(lines[1], "755 root");
    assert_eq!(lines[2], "hello from the recipe file");
    assert_eq!(
        lines[3].trim(),
        "fd full null random stderr stdin stdout tty urandom zero",
        "the build's /dev"
    );
    // /proc/net/dev: two header lines and `lo` only (the build had no network).
    assert_eq!(lines[4], "1", "{}", run.stdout);
    // The pinned wheel, fetched on the host and installed offline by pip.
    assert_eq!(lines[5], "1.17.0", "{}", run.stdout);
}
