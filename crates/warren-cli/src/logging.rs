//! Log records with every field escaped.
//!
//! Log fields carry text a guest or a caller controls: guest error messages inside error
//! chains, failure reasons with a console tail, file names, tool names. tracing-subscriber's
//! own formatter writes `%` fields as they are and escapes only ESC, only in `message`: a
//! guest could write whole forged lines (`\n` followed by a plausible record) into the
//! service's log, or drive the terminal of an operator watching it. [`EscapedFields`]
//! formats each record's fields as tracing-subscriber does, then escapes every control
//! character in them ([`crate::term::escape`], `Shape::Field`: newlines and tabs too), so a
//! record is one line whatever its fields hold. It is the field formatter of every log this
//! binary writes (the service's, the CLI's, the supervisors').

use std::fmt;

use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::{DefaultFields, Writer};
use tracing_subscriber::fmt::FormatFields;

use crate::term::{escape, Shape};

/// Formats fields as [`DefaultFields`] does (without colours), with control characters
/// escaped.
#[derive(Debug, Default)]
pub struct EscapedFields {
    inner: DefaultFields,
}

impl<'w> FormatFields<'w> for EscapedFields {
    fn format_fields<R: RecordFields>(&self, mut writer: Writer<'w>, fields: R) -> fmt::Result {
        let mut plain = String::new();
        self.inner.format_fields(Writer::new(&mut plain), fields)?;
        writer.write_str(&escape(&plain, Shape::Field))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::prelude::*;

    use super::*;

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("sink").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A guest's error text with a newline, a forged record and ESC stays inside one record,
    /// in a `%` field, in the message and in a span's fields. (With tracing-subscriber's own
    /// field formatter the forged line and the raw ESC reach the log.)
    #[test]
    fn test_guest_text_cannot_forge_a_log_line() {
        let sink = Sink::default();
        let writer = sink.clone();
        let layer = tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .fmt_fields(EscapedFields::default())
            .with_writer(move || writer.clone());
        let subscriber = tracing_subscriber::registry().with(layer);
        let hostile = "busy\r\n2026-01-01T00:00:00Z  INFO warren_api::service: token revoked workspace=admin \u{1b}[2J\u{9b}";
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("call", tool = %hostile);
            let _in = span.enter();
            tracing::warn!(vm = "vm-1", error = %hostile, "idle suspend failed");
            tracing::warn!("guest said {hostile}");
        });
        let out = String::from_utf8(sink.0.lock().expect("sink").clone()).expect("utf-8");
        assert_eq!(out.lines().count(), 2, "{out}");
        assert!(
            !out.contains('\u{1b}') && !out.contains('\u{9b}') && !out.contains('\r'),
            "{out:?}"
        );
        assert!(out.contains(r"busy\r\n2026-01-01"), "{out}");
        assert!(out.contains(r"\u{1b}[2J"), "{out}");
    }
}
