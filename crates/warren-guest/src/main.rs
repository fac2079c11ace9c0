//! `warren-guest`: Warren's in-guest agent, PID 1 of the initramfs.
//!
//! [`boot`] brings the guest up in named phases (and powers off on failure), then the agent
//! serves the host over the virtio-serial port ([`channel`], [`session`]) with jobs
//! ([`jobs`] on pipes or pseudo-terminals ([`pty`]), exec retries deduplicated by
//! [`request_keys`]) and file operations ([`files`], plus the versioned, atomic and search
//! operations of [`workspace_ops`]); after a resume [`coherence`] brings the shares' cached names up to
//! date. All `unsafe` code is in [`sys`].

mod boot;
mod bulk;
mod channel;
mod clock;
mod coherence;
mod console;
mod files;
mod identity;
mod identity_files;
mod jobs;
mod pty;
mod reaper;
mod request_keys;
mod session;
mod streams;
mod sys;
mod trust;
mod unpack;
mod workspace_ops;

fn main() {
    if std::process::id() != 1 {
        eprintln!("warren-guest: this is the guest agent; it only runs as PID 1 of a Warren VM");
        std::process::exit(2);
    }
    let booted = boot::boot().unwrap_or_else(|(phase, err)| boot::fail(phase, &err));
    // Before the runtime's threads exist, so they inherit it; jobs go back to 0 (`sys`).
    if let Err(e) = rustix::process::setpriority_process(None, sys::AGENT_NICE) {
        console::log(format_args!("agent priority: {e}"));
    }
    // One runtime thread: guests usually have one vCPU, and under TCG every cross-thread
    // wakeup is expensive (blocking file work still runs on tokio's blocking pool).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| boot::fail("runtime", &e));
    if let Err((phase, err)) = runtime.block_on(boot::serve(booted)) {
        boot::fail(phase, &*err);
    }
}
