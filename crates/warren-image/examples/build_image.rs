//! Builds an image for real: `build_image <image_dir> <minimal|dev> <agent>`, then verifies it
//! and prints the paths. Used for manual end-to-end checks of the builder.

use std::path::Path;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, dir, recipe, agent] = args.as_slice() else {
        return Err("usage: build_image <image_dir> <minimal|dev> <agent>".into());
    };
    let store = warren_image::ImageStore::open(Path::new(dir))?;
    let start = Instant::now();
    let id = store.build(
        &warren_image::Recipe::builtin(recipe)?,
        Path::new(agent),
        &mut |p| {
            println!(
                "[{:>6.1}s] {}: {}",
                start.elapsed().as_secs_f64(),
                p.step,
                p.detail
            );
        },
    )?;
    println!("built {id} in {:.1?}", start.elapsed());
    let t = Instant::now();
    let v = store.verify(&id)?;
    println!("verified in {:.1?}: {v:#?}", t.elapsed());
    if let Ok(out) = std::env::var("VM_INITRAMFS") {
        let t = Instant::now();
        warren_image::write_vm_initramfs(&v.initramfs, &[b'S'; 32], Path::new(&out))?;
        println!("vm initramfs {out} written in {:.1?}", t.elapsed());
    }
    for info in store.list()? {
        println!("{info:?}");
    }
    Ok(())
}
