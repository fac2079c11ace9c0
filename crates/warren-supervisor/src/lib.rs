//! The per-VM supervisor.
//!
//! One supervisor process runs per VM, started detached by whoever creates the VM (the CLI
//! now, `warrend` later) and outliving it. It owns everything that serves exactly one client:
//! the VMM process, its control socket, the serial console and the agent channel (a
//! virtio-serial port). Any number of local clients talk to it over a private UNIX socket
//! (`supervisor.sock` in the VM directory, mode 0600), one request per connection.
//!
//! Lifecycle, in order:
//! 1. take the VM directory's lock (held for the process lifetime: a free lock means no
//!    supervisor), bind `supervisor.sock`;
//! 2. launch the VMM in the VM's cgroup, as the VM's uid, dying with the supervisor;
//! 3. drain the VMM's and its helpers' stderr into bounded logs ([`child_log`]), connect
//!    the console (the VMM waits for it, so no byte is lost) into a bounded log;
//! 4. connect the channel: resync, HTTP/2, mutual authentication ([`channel`]);
//! 5. serve clients until the VMM exits or a client asks to stop;
//! 6. kill the cgroup, record why the VM ended in `exit.json`, remove the sockets, exit.

pub mod channel;
pub mod child_log;
pub mod client;
pub mod console;
pub mod deadline;
mod fork;
pub mod frame_meter;
pub mod layout;
pub mod log;
pub mod network;
pub mod proto;
mod rekey;
pub mod rotate;
mod server;
mod stream;
pub mod stream_frame;
mod timings;

pub use client::SupervisorClient;
pub use layout::{CloneSpec, ExitRecord, SupervisorConfig, VmDir};
pub use proto::{SupervisorError, SupervisorRequest, SupervisorResponse, VmPhase};
pub use server::{run, vmm_digests};
