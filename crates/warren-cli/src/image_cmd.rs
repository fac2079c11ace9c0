//! `warren image ...`: build (a built-in recipe or a recipe file), list, remove.
//!
//! Build and pull progress go through [`crate::progress::Progress`], like every long
//! operation's.

use std::path::PathBuf;

use anyhow::{Context, Result};
use warren_image::{BuildProgress, Recipe};

use crate::cli::{Cli, ImageCmd};
use crate::commands::open;
use crate::progress::Progress;

/// Reports one build or pull event as a step of `progress`.
fn report(progress: &Progress, p: &BuildProgress) {
    progress.step(&format!("{}: {}", p.step, p.detail));
}

pub(crate) fn find_agent() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("binary has no directory")?;
    let profile = dir.file_name().map(|s| s.to_owned()).unwrap_or_default();
    let candidates = [
        dir.join("warren-guest"),
        // The Debian package: /usr/bin/warren and /usr/lib/warren/warren-guest.
        dir.join("../lib/warren/warren-guest"),
        dir.join("../x86_64-unknown-linux-gnu/release/warren-guest"),
        dir.join("../x86_64-unknown-linux-gnu")
            .join(&profile)
            .join("warren-guest"),
    ];
    // Only a static binary can be PID 1 of the initramfs: `cargo build` also leaves a
    // dynamically linked `warren-guest` next to this binary, which must not be picked.
    candidates
        .into_iter()
        .find(|p| p.is_file() && warren_image::store::is_static_elf(p).unwrap_or(false))
        .map(|p| p.canonicalize().unwrap_or(p))
        .context(
            "no static warren-guest binary found; build it with scripts/build-guest.sh \
             or pass --agent",
        )
}

/// The recipe `image build` was given: a built-in name or a recipe file (root only: recipe
/// files are operator input).
fn chosen_recipe(recipe: Option<&str>, file: Option<&PathBuf>) -> Result<Recipe> {
    match (recipe, file) {
        (Some(_), Some(_)) => Err(warren_core::CoreError::InvalidArgument(
            "give --recipe or --recipe-file, not both".into(),
        )
        .into()),
        (_, Some(f)) => {
            if !nix::unistd::geteuid().is_root() {
                return Err(warren_core::CoreError::InvalidArgument(
                    "recipe files are built by root only (they are operator input)".into(),
                )
                .into());
            }
            Ok(Recipe::from_file(f).map_err(warren_core::CoreError::from)?)
        }
        (name, None) => Ok(Recipe::builtin(name.unwrap_or("dev")).map_err(|_| {
            warren_core::CoreError::InvalidArgument(format!(
                "unknown recipe {:?} (expected minimal, dev or agents, or --recipe-file)",
                name.unwrap_or_default()
            ))
        })?),
    }
}

pub(crate) async fn image(cli: &Cli, cmd: &ImageCmd) -> Result<i32> {
    let w = open(cli, None)?;
    match cmd {
        ImageCmd::Build {
            recipe,
            recipe_file,
            agent,
        } => {
            let recipe = chosen_recipe(recipe.as_deref(), recipe_file.as_ref())?;
            let agent = match agent {
                Some(a) => a.clone(),
                None => find_agent()?,
            };
            let progress = Progress::steps(format!("image {}", recipe.name()));
            let id = w
                .images()
                .build(&recipe, &agent, &mut |p| report(&progress, &p))?;
            progress.finish(Some(&format!("built {id}")));
            println!("{id}");
            Ok(0)
        }
        ImageCmd::Pull {
            reference,
            agent,
            disk_size_mib,
            timeout_secs,
        } => {
            let agent = match agent {
                Some(a) => a.clone(),
                None => find_agent()?,
            };
            let opts = warren_image::pull::PullOptions {
                disk_size: disk_size_mib.map(|m| m << 20),
                deadline: std::time::Duration::from_secs(*timeout_secs),
                ..Default::default()
            };
            let progress = Progress::steps(format!("pull {reference}"));
            let id = w
                .pull_image(reference, &agent, opts, &mut |p| report(&progress, &p))
                .await?;
            progress.finish(Some(&format!("pulled {id}")));
            println!("{id}");
            Ok(0)
        }
        ImageCmd::Resolve { reference } => {
            let pinned = warren_image::pull::resolve(reference)
                .await
                .map_err(warren_core::CoreError::from)?;
            println!("{pinned}");
            Ok(0)
        }
        ImageCmd::Sign {
            image,
            key,
            builder_id,
        } => {
            let id = w
                .images()
                .resolve(image)
                .map_err(warren_core::CoreError::from)?;
            let pem = std::fs::read(key).with_context(|| key.display().to_string())?;
            let signer = warren_image::trust::SigningKey::from_pem(&pem).map_err(|e| {
                warren_core::CoreError::InvalidArgument(format!("{}: {e}", key.display()))
            })?;
            let images = w.images();
            images.verify(&id).map_err(warren_core::CoreError::from)?;
            let manifest = images.manifest(&id).map_err(warren_core::CoreError::from)?;
            let subject = images.subject(&id).map_err(warren_core::CoreError::from)?;
            let name = format!("warren-image/{}", manifest.recipe);
            let mut add = warren_image::trust::TrustMaterial {
                signatures: vec![signer
                    .sign_image(&subject, &name)
                    .map_err(warren_core::CoreError::InvalidArgument)?],
                ..Default::default()
            };
            if let Some(builder) = builder_id {
                let predicate = serde_json::json!({
                    "buildDefinition": {
                        "buildType": "https://warren.dev/image-build/v1",
                        "externalParameters": {
                            "recipe": manifest.recipe,
                            "recipe_digest": manifest.recipe_digest,
                        },
                        "resolvedDependencies": [
                            {"name": "agent", "digest": {"sha256": manifest.agent_sha256}},
                            {"name": "kernel", "digest": {"sha256": manifest.files.get("vmlinux").map(|f| f.sha256.clone()).unwrap_or_default()}},
                        ],
                    },
                    "runDetails": {"builder": {"id": builder}},
                });
                add.attestations.push(
                    signer
                        .attest(
                            &subject,
                            &name,
                            warren_image::trust::SLSA_PROVENANCE_V1,
                            predicate,
                        )
                        .map_err(warren_core::CoreError::InvalidArgument)?,
                );
            }
            images
                .add_trust(&id, add)
                .map_err(warren_core::CoreError::from)?;
            eprintln!(
                "signed {subject}{}",
                if builder_id.is_some() {
                    " and attested its provenance"
                } else {
                    ""
                }
            );
            println!("{id}");
            Ok(0)
        }
        ImageCmd::Keygen { out } => {
            let (private, public) = warren_image::trust::generate_key_pair()
                .map_err(warren_core::CoreError::InvalidArgument)?;
            let key = out.with_extension("key");
            let pubf = out.with_extension("pub");
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&key)
                .with_context(|| key.display().to_string())?;
            f.write_all(private.as_bytes())?;
            std::fs::write(&pubf, public)?;
            eprintln!(
                "wrote {} (private, 0600) and {}",
                key.display(),
                pubf.display()
            );
            Ok(0)
        }
        ImageCmd::Verify { image } => {
            let id = w
                .images()
                .resolve(image)
                .map_err(warren_core::CoreError::from)?;
            w.verify_image(&id)?;
            match w.check_image_policy(&id)? {
                None => println!("{id}: files verified; no image policy in force"),
                Some(v) => println!(
                    "{id}: files verified; signed by {}{} (policy version {})",
                    v.signed_by,
                    if v.attested_by.is_empty() {
                        String::new()
                    } else {
                        format!(", attested by {}", v.attested_by.join(", "))
                    },
                    v.policy_version
                ),
            }
            Ok(0)
        }
        ImageCmd::List { json } => {
            let list = w.images().list()?;
            if *json {
                let v: Vec<_> = list
                    .iter()
                    .map(|i| {
                        serde_json::json!({
                            "image_id": i.id.to_string(),
                            "recipe": i.recipe,
                            "kernel_release": i.kernel_release,
                            "created_unix": i.created_unix,
                            "rootfs_size": i.rootfs_size,
                            "disk_bytes": i.disk_bytes,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!(
                    "{:<66} {:<12} {:<22} {:>10}",
                    "IMAGE", "RECIPE", "KERNEL", "DISK MiB"
                );
                for i in list {
                    println!(
                        "{:<66} {:<12} {:<22} {:>10}",
                        i.id.to_string(),
                        i.recipe,
                        i.kernel_release,
                        i.disk_bytes / (1024 * 1024)
                    );
                }
            }
            Ok(0)
        }
        ImageCmd::Rm { image } => {
            let id = w.remove_image(image)?;
            println!("removed {id}");
            Ok(0)
        }
    }
}
