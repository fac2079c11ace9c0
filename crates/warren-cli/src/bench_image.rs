//! `warren bench --suite image`: pulling an OCI image equivalent to a recipe's image (its root
//! file system packed as one gzip layer, pushed to a registry on loopback) against building
//! that recipe from scratch, in one run, with the physical floor of the pull measured on the
//! same layer: GNU `tar -xzf` of the blob plus `mkfs.ext4 -d` of the tree.
//!
//! Tools: Debian's `docker-registry` (started here on 127.0.0.1), `umoci`, `skopeo`,
//! `debugfs`, `tar` and `mkfs.ext4`. Every pull goes into a fresh image store holding only
//! the kernel stage (hard links), so none is a cache hit; the recipe build runs in a fresh
//! store too (no stage cache). Pulls: `--boots` times (median); recipe builds: `--builds`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use warren_image::{BuildProgress, ImageStore, Recipe};

use crate::bench::median;
use crate::cli::{BenchArgs, Cli};

#[derive(serde::Serialize)]
struct Report {
    image: String,
    recipe: String,
    pulls: usize,
    layer_mib: f64,
    content_mib: f64,
    pull_s_median: f64,
    pull_setup_s_median: f64,
    pull_layers_s_median: f64,
    pull_finish_s_median: f64,
    floor_untar_s: f64,
    floor_mkfs_s: f64,
    floor_s: f64,
    pull_vs_floor: f64,
    pulled_disk_mib: f64,
    recipe_builds: usize,
    recipe_build_s_median: f64,
    recipe_disk_mib: f64,
    pull_vs_recipe_build: f64,
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("{cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

fn disk_mib(dir: &Path) -> f64 {
    use std::os::unix::fs::MetadataExt;
    ["vmlinux", "initramfs.cpio", "rootfs.ext4"]
        .iter()
        .filter_map(|f| std::fs::metadata(dir.join(f)).ok())
        .map(|m| (m.blocks() * 512) as f64)
        .sum::<f64>()
        / (1 << 20) as f64
}

/// A store with (hard links of) the kernel stage of `src` only.
fn kernel_only_store(src: &ImageStore, at: &Path) -> Result<ImageStore> {
    let store = ImageStore::open(at)?;
    let stage = Recipe::builtin(warren_image::recipe::KERNEL_RECIPE)?.stage_digest();
    let from = src.root().join("cache/stages").join(&stage);
    if !from.is_dir() {
        bail!("the kernel stage is not built: warren image build --recipe minimal");
    }
    let to = store.root().join("cache/stages").join(&stage);
    std::fs::create_dir_all(&to)?;
    for e in std::fs::read_dir(&from)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            std::fs::create_dir_all(to.join(e.file_name()))?;
            for f in std::fs::read_dir(e.path())? {
                let f = f?;
                std::fs::hard_link(f.path(), to.join(e.file_name()).join(f.file_name()))?;
            }
        } else {
            std::fs::hard_link(e.path(), to.join(e.file_name()))?;
        }
    }
    Ok(store)
}

pub async fn run_bench(cli: &Cli, args: &BenchArgs) -> Result<i32> {
    let main = crate::commands::open(cli, None)?;
    let images = main.images();
    let id = images.resolve(&args.image)?;
    let manifest = images.manifest(&id)?;
    let recipe = Recipe::builtin(&manifest.recipe)
        .with_context(|| format!("{} is not a built-in recipe's image", args.image))?;
    let agent = crate::image_cmd::find_agent()?;
    // Scratch space next to the image store (hard links, and the same disk as real pulls).
    let scratch = tempfile::Builder::new()
        .prefix(".bench-image-")
        .tempdir_in(images.root().parent().unwrap_or(images.root()))?;
    let work = scratch.path();

    // The OCI image: the recipe image's root file system as one layer (umoci), pushed to a
    // registry on loopback (skopeo).
    eprintln!(
        "packing {} ({}) as an OCI image",
        id.short(),
        manifest.recipe
    );
    let tree = work.join("tree");
    std::fs::create_dir(&tree)?;
    run(Command::new("debugfs")
        .arg("-R")
        .arg(format!("rdump / {}", tree.display()))
        .arg(images.root().join(&id.0).join("rootfs.ext4")))?;
    let layout = work.join("layout");
    let l = layout.display().to_string();
    run(Command::new("umoci").args(["init", "--layout", &l]))?;
    run(Command::new("umoci").args(["new", "--image", &format!("{l}:b")]))?;
    run(Command::new("umoci")
        .args(["insert", "--image", &format!("{l}:b")])
        .arg(&tree)
        .arg("/"))?;
    std::fs::remove_dir_all(&tree)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let config = work.join("registry.yml");
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            work.join("registry").display()
        ),
    )?;
    let mut registry = Command::new("docker-registry")
        .arg("serve")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("docker-registry (apt install docker-registry)")?;
    let result = bench(&main, images, &recipe, &agent, work, port, &layout, args).await;
    let _ = registry.kill();
    let _ = registry.wait();
    let mut report = result?;
    report.image = id.0.clone();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(0)
}

#[allow(clippy::too_many_arguments)]
async fn bench(
    main: &warren_core::Warren,
    images: &ImageStore,
    recipe: &Recipe,
    agent: &Path,
    work: &Path,
    port: u16,
    layout: &Path,
    args: &BenchArgs,
) -> Result<Report> {
    let addr = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let digest_file = work.join("digest");
    loop {
        let pushed = Command::new("skopeo")
            .args(["copy", "--quiet", "--dest-tls-verify=false", "--digestfile"])
            .arg(&digest_file)
            .arg(format!("oci:{}:b", layout.display()))
            .arg(format!("docker://{addr}/bench/image:b"))
            .output()?;
        if pushed.status.success() {
            break;
        }
        if Instant::now() > deadline {
            bail!("skopeo copy: {}", String::from_utf8_lossy(&pushed.stderr));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let digest = std::fs::read_to_string(&digest_file)?.trim().to_string();
    let reference = format!("{addr}/bench/image@{digest}");

    // The layer blob as the registry stores it (for the floor).
    let blob = {
        let idx: serde_json::Value =
            serde_json::from_slice(&std::fs::read(layout.join("index.json"))?)?;
        let m = idx["manifests"][0]["digest"]
            .as_str()
            .context("index")?
            .to_string();
        let mf: serde_json::Value = serde_json::from_slice(&std::fs::read(
            layout
                .join("blobs/sha256")
                .join(m.trim_start_matches("sha256:")),
        )?)?;
        let d = mf["layers"][0]["digest"]
            .as_str()
            .context("layer")?
            .to_string();
        layout
            .join("blobs/sha256")
            .join(d.trim_start_matches("sha256:"))
    };
    let layer_mib = std::fs::metadata(&blob)?.len() as f64 / (1 << 20) as f64;

    // Pulls.
    let (mut total, mut setup, mut unpack, mut finish) = (vec![], vec![], vec![], vec![]);
    let mut pulled_disk = 0.0;
    let mut content_mib = 0.0;
    for i in 0..args.boots.max(1) {
        let at = work.join(format!("pull-{i}"));
        let store = kernel_only_store(images, &at)?;
        let started = Instant::now();
        let mut marks: Vec<(&'static str, f64, String)> = Vec::new();
        let id = warren_image::pull::pull(
            &store,
            &reference,
            agent,
            None,
            warren_image::pull::PullOptions::default(),
            &mut |p: BuildProgress| marks.push((p.step, started.elapsed().as_secs_f64(), p.detail)),
        )
        .await?;
        let t = started.elapsed().as_secs_f64();
        let at_step = |s: &str| marks.iter().find(|m| m.0 == s).map(|m| m.1).unwrap_or(t);
        let (layer0, unpacked, rootfs) = (at_step("layer"), at_step("unpack"), at_step("rootfs"));
        total.push(t);
        setup.push(layer0);
        unpack.push(unpacked - layer0);
        finish.push(t - rootfs);
        if let Some(m) = marks.iter().find(|m| m.0 == "unpack") {
            // "<n> files, <n> dirs, <n> links, <n> MiB; ..."
            content_mib =
                m.2.split(", ")
                    .nth(3)
                    .and_then(|s| s.split(' ').next())
                    .and_then(|n| n.parse::<f64>().ok())
                    .unwrap_or(0.0);
        }
        pulled_disk = disk_mib(&store.root().join(&id.0));
        eprintln!("pull {}: {t:.1} s", i + 1);
        std::fs::remove_dir_all(&at)?;
    }

    // The floor: GNU tar unpacking the same blob, mkfs.ext4 of the tree.
    let tree = work.join("floor-tree");
    std::fs::create_dir(&tree)?;
    let t = Instant::now();
    run(Command::new("tar")
        .arg("-xzf")
        .arg(&blob)
        .arg("-C")
        .arg(&tree)
        .arg("--numeric-owner"))?;
    let floor_untar = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let size_k = ((content_mib as u64) * 2 + 1024).max(2048) * 1024;
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(&tree)
        .arg(work.join("floor.ext4"))
        .arg(format!("{size_k}k")))?;
    let floor_mkfs = t.elapsed().as_secs_f64();
    std::fs::remove_dir_all(&tree)?;
    let _ = std::fs::remove_file(work.join("floor.ext4"));

    // Recipe builds from scratch (no stage cache).
    let mut builds = vec![];
    let mut recipe_disk = 0.0;
    for i in 0..args.builds {
        let store = ImageStore::open(&work.join(format!("build-{i}")))?;
        let started = Instant::now();
        let id = store.build(recipe, agent, &mut |p| {
            if matches!(p.step, "debootstrap" | "kernel" | "mkfs" | "stage") {
                eprintln!("  build {}: {}: {}", i + 1, p.step, p.detail);
            }
        })?;
        builds.push(started.elapsed().as_secs_f64());
        recipe_disk = disk_mib(&store.root().join(&id.0));
        std::fs::remove_dir_all(store.root())?;
    }
    let _ = main;
    let pull_s_median = median(&mut total.clone());
    let floor_s = floor_untar + floor_mkfs;
    let recipe_build_s_median = median(&mut builds.clone());
    Ok(Report {
        image: String::new(),
        recipe: recipe.name().to_string(),
        pulls: total.len(),
        layer_mib,
        content_mib,
        pull_s_median,
        pull_setup_s_median: median(&mut setup),
        pull_layers_s_median: median(&mut unpack),
        pull_finish_s_median: median(&mut finish),
        floor_untar_s: floor_untar,
        floor_mkfs_s: floor_mkfs,
        floor_s,
        pull_vs_floor: pull_s_median / floor_s,
        pulled_disk_mib: pulled_disk,
        recipe_builds: builds.len(),
        recipe_build_s_median,
        recipe_disk_mib: recipe_disk,
        pull_vs_recipe_build: pull_s_median / recipe_build_s_median,
    })
}

fn print_report(r: &Report) {
    println!(
        "image {} ({}), one {:.0} MiB gzip layer, {:.0} MiB of content",
        &r.image[..12.min(r.image.len())],
        r.recipe,
        r.layer_mib,
        r.content_mib
    );
    println!(
        "pull + unpack + assemble (median of {})  {:>8.1} s  (manifest, trust, config {:.1} s; layer download+verify+unpack {:.1} s; user, mkfs, assemble {:.1} s)",
        r.pulls, r.pull_s_median, r.pull_setup_s_median, r.pull_layers_s_median, r.pull_finish_s_median
    );
    println!(
        "floor: tar -xzf {:.1} s + mkfs.ext4 -d {:.1} s = {:.1} s; pull/floor = {:.2}",
        r.floor_untar_s, r.floor_mkfs_s, r.floor_s, r.pull_vs_floor
    );
    if r.recipe_builds > 0 {
        println!(
            "recipe build from scratch (median of {}) {:>8.1} s; pull/build = {:.3}",
            r.recipe_builds, r.recipe_build_s_median, r.pull_vs_recipe_build
        );
    }
    println!(
        "disk: pulled image {:.0} MiB, recipe image {:.0} MiB",
        r.pulled_disk_mib, r.recipe_disk_mib
    );
}
