//! Guest-controlled text on its way to a terminal.
//!
//! A guest controls file names, its console output, what ends up in failure reasons and in
//! many error messages. Printed as is, such text can drive the user's terminal: ESC and CSI
//! start sequences that move the cursor, rewrite or hide what is on screen, set the window
//! title, or make some terminals answer back as if the user had typed. So every command
//! prints that text through [`Term`], which escapes each control character (Unicode
//! category Cc: C0, DEL, and C1 as the code points U+0080..U+009F) the way Rust's
//! `char::escape_debug` spells it (`\u{1b}`, `\u{9b}`, `\r`, `\0`), keeping only what the
//! text's [`Shape`] needs, and so are the line and paragraph separators and the
//! bidirectional controls, which break or reorder a line without being control characters.
//! `--raw` turns escaping off.
//!
//! Byte streams the user asked for (`vm exec`, `vm read`, `vm output`, `warren run`) never
//! pass through here: they stay raw, as `ssh` leaves them. JSON output (`--json`) is escaped
//! by serde instead.

use std::borrow::Cow;

/// How much line structure a piece of text keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// One item of a list or a table cell (a path, a name, a reason): every control character
    /// is escaped, newline and tab included, so an item stays one item on one line.
    Field,
    /// One line (a `vm grep` match): tabs kept.
    Line,
    /// Lines of text (a console log, an error message): newlines and tabs kept, and a
    /// carriage return right before a newline.
    Text,
}

/// Whether `c` is escaped (unless its shape keeps it): a control character (Cc), or one of
/// the characters that break or reorder a line without being one: the line and paragraph
/// separators (U+2028, U+2029, new lines to many log viewers and JSON-based shippers) and the
/// bidirectional embeddings, overrides and isolates (U+202A..U+202E, U+2066..U+2069, which
/// make a terminal show text in another order than it is written).
fn special(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `s` with its control characters escaped for `shape`; borrowed when nothing changes.
pub fn escape(s: &str, shape: Shape) -> Cow<'_, str> {
    if !s.chars().any(special) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if special(c) && !kept(c, chars.peek().copied(), shape) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Whether control character `c` (followed by `next`) stays as it is in `shape`.
fn kept(c: char, next: Option<char>, shape: Shape) -> bool {
    match (shape, c) {
        (Shape::Line | Shape::Text, '\t') => true,
        (Shape::Text, '\n') => true,
        (Shape::Text, '\r') => next == Some('\n'),
        _ => false,
    }
}

/// How this invocation prints guest-controlled text: escaped, or raw with `--raw`.
#[derive(Clone, Copy, Debug)]
pub struct Term {
    raw: bool,
}

impl Term {
    pub fn new(raw: bool) -> Term {
        Term { raw }
    }

    fn shaped<'a>(&self, s: &'a str, shape: Shape) -> Cow<'a, str> {
        if self.raw {
            Cow::Borrowed(s)
        } else {
            escape(s, shape)
        }
    }

    /// A list item or table cell ([`Shape::Field`]).
    pub fn field<'a>(&self, s: &'a str) -> Cow<'a, str> {
        self.shaped(s, Shape::Field)
    }

    /// One line ([`Shape::Line`]).
    pub fn line<'a>(&self, s: &'a str) -> Cow<'a, str> {
        self.shaped(s, Shape::Line)
    }

    /// Lines of text ([`Shape::Text`]).
    pub fn text<'a>(&self, s: &'a str) -> Cow<'a, str> {
        self.shaped(s, Shape::Text)
    }

    /// Prints `warning: <m>` on stderr, `m` as text.
    pub fn warn(&self, m: &str) {
        eprintln!("warning: {}", self.text(m));
    }

    /// The line `warren: <what>: <e>` for an error a command reports and goes on (a
    /// port-forward connection that failed, a stream that closed badly): `e` may quote the
    /// guest (its refusal of a stream, a failed guest end), so it is text like any error
    /// `main` prints.
    pub fn failure(&self, what: &str, e: &dyn std::fmt::Display) -> String {
        format!("warren: {what}: {}", self.text(&format!("{e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failure a command reports and survives (`warren port-forward`'s per-connection
    /// line, `warren attach`'s close reason) quotes the guest's refusal escaped; before, those
    /// lines were printed raw, so a guest answering a stream with an error holding ESC and OSC
    /// sequences drove the user's terminal. `--raw` prints it as it is.
    #[test]
    fn test_failure_lines_escape_the_guest_text_they_quote() {
        let guest = "nothing listens\u{1b}]0;owned\u{7}\u{1b}[2J\u{9b}31m";
        let e = anyhow::anyhow!("{guest}").context("opening the stream");
        let line = Term::new(false).failure("connection from 127.0.0.1:5", &e);
        assert!(!line.chars().any(char::is_control), "{line:?}");
        assert!(
            line.contains("opening the stream: nothing listens\\u{1b}]0;owned"),
            "{line}"
        );
        let raw = Term::new(true).failure("connection from 127.0.0.1:5", &e);
        assert!(raw.contains('\u{1b}'), "{raw:?}");
    }

    /// Every control character, in each shape: C0, DEL and C1 escaped unless kept.
    #[test]
    fn test_escape_every_control_character_unless_kept() {
        for shape in [Shape::Field, Shape::Line, Shape::Text] {
            for c in (0u32..0x20).chain([0x7f]).chain(0x80..0xa0) {
                let c = char::from_u32(c).expect("a scalar value");
                let s = format!("a{c}b");
                let out = escape(&s, shape);
                if kept(c, Some('b'), shape) {
                    assert_eq!(out, s, "{c:?} in {shape:?}");
                } else {
                    assert!(!out.contains(c), "{c:?} in {shape:?}: {out:?}");
                    assert!(!out.chars().any(char::is_control), "{out:?}");
                    assert_eq!(out, format!("a{}b", c.escape_debug()));
                }
            }
        }
    }

    /// Line separators and bidirectional controls are escaped in every shape: a log record
    /// stays one line in viewers that break on U+2028, and text cannot be shown reordered.
    /// (Before, they passed as they were.)
    #[test]
    fn test_line_separators_and_bidi_controls_escaped() {
        for shape in [Shape::Field, Shape::Line, Shape::Text] {
            for c in ['\u{2028}', '\u{2029}', '\u{202e}', '\u{2066}', '\u{2069}'] {
                let s = format!("a{c}b");
                let out = escape(&s, shape);
                assert!(!out.contains(c), "{c:?} in {shape:?}: {out:?}");
                assert_eq!(out, format!("a{}b", c.escape_unicode()));
            }
        }
        assert_eq!(escape("plain é", Shape::Field), "plain é");
    }

    #[test]
    fn test_escape_spells_sequences_visibly() {
        let s = "x\u{1b}[31mred\u{1b}]0;title\u{7}\u{9b}2J\u{7f}";
        assert_eq!(
            escape(s, Shape::Text),
            r"x\u{1b}[31mred\u{1b}]0;title\u{7}\u{9b}2J\u{7f}"
        );
    }

    #[test]
    fn test_escape_shapes_keep_their_structure() {
        let s = "a\tb\nc\r\nd\re\r";
        assert_eq!(escape(s, Shape::Field), r"a\tb\nc\r\nd\re\r");
        assert_eq!(escape(s, Shape::Line), "a\tb\\nc\\r\\nd\\re\\r");
        assert_eq!(escape(s, Shape::Text), "a\tb\nc\r\nd\\re\\r");
    }

    #[test]
    fn test_escape_plain_text_borrowed_and_unchanged() {
        let s = "naïve café, 日本語, emoji 🦀, backslash \\ and quotes \"'";
        assert!(matches!(escape(s, Shape::Field), Cow::Borrowed(x) if x == s));
        // Printable characters right next to the C1 range stay.
        assert_eq!(escape("\u{a0}\u{ff}", Shape::Field), "\u{a0}\u{ff}");
    }

    #[test]
    fn test_term_raw_leaves_text_alone() {
        let s = "e\u{1b}[2J\u{9b}\n";
        assert_eq!(Term::new(true).field(s), s);
        assert_eq!(Term::new(true).text(s), s);
        assert_eq!(Term::new(false).field(s), r"e\u{1b}[2J\u{9b}\n");
        assert_eq!(Term::new(false).line(s), r"e\u{1b}[2J\u{9b}\n");
        assert_eq!(Term::new(false).text(s), "e\\u{1b}[2J\\u{9b}\n");
    }
}
