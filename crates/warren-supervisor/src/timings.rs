//! Where a supervisor's start goes: named steps in milliseconds since the process started,
//! reported in `Status` (`warren bench --suite instant` prints them).

use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Steps of this supervisor's start, in milliseconds since the process started.
#[derive(Clone)]
pub(crate) struct Timings {
    started: Instant,
    steps: Arc<Mutex<Vec<(String, u64)>>>,
}

impl Timings {
    pub(crate) fn new() -> Timings {
        Timings {
            started: Instant::now(),
            steps: Arc::default(),
        }
    }

    pub(crate) fn mark(&self, step: &str) {
        let ms = self.started.elapsed().as_millis() as u64;
        tracing::debug!(step, ms, "start step");
        self.steps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((step.to_string(), ms));
    }

    pub(crate) fn get(&self) -> Vec<(String, u64)> {
        self.steps.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
