//! Log records with every field escaped and every ambiguous value quoted.
//!
//! Log fields carry text a guest or a caller controls: guest error messages inside error
//! chains, failure reasons with a console tail, file names, tool names. tracing-subscriber's
//! own formatter writes `%` fields as they are and escapes only ESC, only in `message`: a
//! guest could write whole forged lines (`\n` followed by a plausible record) into the
//! service's log, drive the terminal of an operator watching it, or make one field read as
//! several (`error=busy workspace=admin`). [`EscapedFields`] writes each record's fields
//! itself: the message as text, every other field as `name=value`, and a value (or a
//! message) that holds a space, `=`, a quote, a backslash or a control character is written
//! quoted, with Rust's string escapes (`"busy workspace=admin"`, `"a\\b"`); what is left is
//! then escaped once more for control characters ([`crate::term::escape`], `Shape::Field`),
//! so a record is one line whatever its fields hold and a field is one field. It is the
//! field formatter of every log this binary writes (the service's, the CLI's, the
//! supervisors').
//!
//! Written by hand because tracing-subscriber offers no quoting field formatter short of
//! JSON output; this is its `DefaultFields` layout (message first, then `name=value`).

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::FormatFields;

use crate::term::{escape, Shape};

/// Formats fields as tracing-subscriber's `DefaultFields` lays them out (without colours),
/// with ambiguous values quoted and control characters escaped.
#[derive(Debug, Default)]
pub struct EscapedFields;

impl<'w> FormatFields<'w> for EscapedFields {
    fn format_fields<R: RecordFields>(&self, mut writer: Writer<'w>, fields: R) -> fmt::Result {
        let mut v = Fields::new();
        fields.record(&mut v);
        v.result?;
        writer.write_str(&escape(&v.out, Shape::Field))
    }

    fn add_fields(
        &self,
        current: &'w mut tracing_subscriber::fmt::FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> fmt::Result {
        let mut v = Fields::new();
        fields.record(&mut v);
        v.result?;
        if !current.fields.is_empty() && !v.out.is_empty() {
            current.fields.push(' ');
        }
        current.fields.push_str(&escape(&v.out, Shape::Field));
        Ok(())
    }
}

struct Fields {
    out: String,
    result: fmt::Result,
}

impl Fields {
    fn new() -> Fields {
        Fields {
            out: String::new(),
            result: Ok(()),
        }
    }

    fn push(&mut self, field: &Field, value: &str) {
        if !self.out.is_empty() {
            self.out.push(' ');
        }
        let message = field.name() == "message";
        if !message {
            self.out.push_str(field.name());
            self.out.push('=');
        }
        if needs_quotes(value, message) {
            self.result = self.result.and(write!(self.out, "{value:?}"));
        } else {
            self.out.push_str(value);
        }
    }
}

/// Whether `value` could read as more (or less) than one value: a field's value with a
/// space, a brace (a span's fields end at `}`), or empty; either with `=`, a quote, a
/// backslash or a control character.
fn needs_quotes(value: &str, message: bool) -> bool {
    (!message && value.is_empty())
        || value.chars().any(|c| {
            c == '='
                || c == '"'
                || c == '\\'
                || c.is_control()
                || (!message && (c.is_whitespace() || c == '{' || c == '}'))
        })
        || escape(value, Shape::Field) != value
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.push(field, value);
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        let mut text = value.to_string();
        let mut source = value.source();
        while let Some(s) = source {
            text.push_str(": ");
            text.push_str(&s.to_string());
            source = s.source();
        }
        self.push(field, &text);
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let mut text = String::new();
        self.result = self.result.and(write!(text, "{value:?}"));
        self.push(field, &text);
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
            .fmt_fields(EscapedFields)
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

    /// The words of `line` a reader splitting on spaces outside quotes sees.
    fn unquoted_words(line: &str) -> Vec<String> {
        let (mut words, mut word, mut quoted, mut escaped) = (vec![], String::new(), false, false);
        for c in line.chars() {
            match c {
                _ if escaped => escaped = false,
                '\\' if quoted => escaped = true,
                '"' => quoted = !quoted,
                ' ' if !quoted => {
                    words.push(std::mem::take(&mut word));
                    continue;
                }
                _ => {}
            }
            word.push(c);
        }
        words.push(word);
        words
    }

    /// Guest text cannot make one field read as several (or a message read as fields), and
    /// a literal backslash stays apart from an escaped control character. Plain values stay
    /// unquoted.
    #[test]
    fn test_guest_text_cannot_forge_a_field() {
        let sink = Sink::default();
        let writer = sink.clone();
        let layer = tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .fmt_fields(EscapedFields)
            .with_writer(move || writer.clone());
        let subscriber = tracing_subscriber::registry().with(layer);
        let hostile = "busy workspace=admin";
        let braces = "x}:admin{n";
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("call", tool = %hostile, n = 3, name = %braces);
            let _in = span.enter();
            tracing::warn!(vm = "vm-1", error = %hostile, path = %r"a\u{1b}", "idle suspend failed");
            tracing::warn!(empty = "", "guest said {hostile}");
        });
        let out = String::from_utf8(sink.0.lock().expect("sink").clone()).expect("utf-8");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{out}");
        for line in &lines {
            assert!(
                !unquoted_words(line)
                    .iter()
                    .any(|w| w.starts_with("workspace=")),
                "a forged field: {line}"
            );
        }
        assert!(
            lines[0].contains(r#"error="busy workspace=admin""#),
            "{out}"
        );
        assert!(lines[0].contains(r#"tool="busy workspace=admin""#), "{out}");
        // A span's fields end at `}`: a brace in a value cannot end them early (found by a
        // hostile review: `call{name=x}:admin{n}` read as a second span).
        assert!(lines[0].contains(r#"name="x}:admin{n""#), "{out}");
        assert!(lines[0].contains(r#"path="a\\u{1b}""#), "{out}");
        assert!(
            lines[0].contains("vm=vm-1 ") && lines[0].contains("n=3"),
            "{out}"
        );
        assert!(lines[0].contains("idle suspend failed vm=vm-1"), "{out}");
        assert!(
            lines[1].contains(r#""guest said busy workspace=admin" empty="""#),
            "{out}"
        );
    }
}
