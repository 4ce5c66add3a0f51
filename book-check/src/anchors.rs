//! mdBook anchors: `// ANCHOR: name` … `// ANCHOR_END: name`, read as mdBook 0.5 reads them
//! (`ANCHOR:\s*([\w_-]+)` anywhere on the line; anchor lines themselves are never shown).
//!
//! A span opened by `// ANCHOR: name (continued)` continues the span of that name before it:
//! code that must stay out of a listing (the harness's step timer between a user's forward and
//! backward) is cut out by closing the span and continuing it after. mdBook reads the marker
//! as one more span of `name` (its regex stops at the name), which is why the book includes
//! such listings as generated files ([`joined_dedented`]), never by the anchor.

/// Every span of anchor `name` in `text`, in order: the 1-based line of its `ANCHOR:` comment and
/// its body lines (anchor comment lines of any name dropped, as mdBook drops them). A span whose
/// `ANCHOR_END` never comes has `closed == false` and runs to the end of the file.
pub fn spans<'a>(text: &'a str, name: &str) -> Vec<Span<'a>> {
    let mut out: Vec<Span<'a>> = Vec::new();
    let mut open: Option<Span<'a>> = None;
    for (i, line) in text.lines().enumerate() {
        match open.as_mut() {
            Some(span) => {
                if anchor_name(line, "ANCHOR_END:") == Some(name) {
                    span.closed = true;
                    out.push(open.take().expect("open span"));
                } else if anchor_name(line, "ANCHOR:").is_none() && anchor_name(line, "ANCHOR_END:").is_none() {
                    span.lines.push(line);
                }
            }
            None => {
                if anchor_name(line, "ANCHOR:") == Some(name) {
                    open = Some(Span { start_line: i + 1, lines: Vec::new(), closed: false, continues: is_continuation(line) });
                }
            }
        }
    }
    out.extend(open);
    out
}

/// One anchored span of a source file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span<'a> {
    /// 1-based line of the `ANCHOR:` comment.
    pub start_line: usize,
    /// The lines between the anchor comments, anchor comments removed.
    pub lines: Vec<&'a str>,
    /// Whether an `ANCHOR_END` closed it.
    pub closed: bool,
    /// Whether its `ANCHOR:` comment says `(continued)`: it goes on from the span before it.
    pub continues: bool,
}

impl Span<'_> {
    /// True when the span has no line with anything but whitespace.
    pub fn is_blank(&self) -> bool {
        self.lines.iter().all(|l| l.trim().is_empty())
    }
}

/// The anchor name after `marker` (`"ANCHOR:"` or `"ANCHOR_END:"`) on `line`, as mdBook's regex
/// finds it. `ANCHOR:` does not match inside `ANCHOR_END:`.
pub fn anchor_name<'a>(line: &'a str, marker: &str) -> Option<&'a str> {
    let mut from = 0;
    while let Some(pos) = line[from..].find(marker) {
        let at = from + pos;
        from = at + marker.len();
        // As mdBook's regex: optional whitespace, then a name of word characters or `-`.
        let rest = line[from..].trim_start();
        let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '-')).unwrap_or(rest.len());
        if end > 0 {
            return Some(&rest[..end]);
        }
    }
    None
}

/// True when the `ANCHOR:` comment on `line` marks a continuation: `(continued)` after the name.
pub fn is_continuation(line: &str) -> bool {
    line.split_once("ANCHOR:").is_some_and(|(_, rest)| rest.contains("(continued)"))
}

/// The lines of every span, concatenated. A span and the continuations after it
/// ([`Span::continues`]) form one piece: joined line to line and dedented together by the
/// piece's common indentation, so a loop cut around a timer line keeps its nesting. Pieces are
/// dedented each by its own indentation and separated by one blank line.
pub fn joined_dedented(spans: &[Span<'_>]) -> Vec<String> {
    let mut pieces: Vec<Vec<&str>> = Vec::new();
    for span in spans {
        match pieces.last_mut() {
            Some(piece) if span.continues => piece.extend(&span.lines),
            _ => pieces.push(span.lines.clone()),
        }
    }
    let mut out = Vec::new();
    for (k, piece) in pieces.iter().enumerate() {
        if k > 0 {
            out.push(String::new());
        }
        let indent = piece.iter().filter(|l| !l.trim().is_empty()).map(|l| l.len() - l.trim_start().len()).min().unwrap_or(0);
        out.extend(piece.iter().map(|l| if l.trim().is_empty() { String::new() } else { l[indent..].trim_end().to_string() }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_span_drops_nested_anchor_lines() {
        let text = "a\n// ANCHOR: x\nb\n  // ANCHOR: y\nc\n  // ANCHOR_END: y\n// ANCHOR_END: x\nd\n";
        let s = spans(text, "x");
        assert_eq!(s, vec![Span { start_line: 2, lines: vec!["b", "c"], closed: true, continues: false }]);
        assert_eq!(spans(text, "y")[0].lines, vec!["c"]);
        assert!(spans(text, "z").is_empty());
    }

    #[test]
    fn unclosed_and_repeated_spans() {
        let text = "// ANCHOR: x\n1\n// ANCHOR_END: x\n// ANCHOR: x\n2\n";
        let s = spans(text, "x");
        assert_eq!(s.len(), 2);
        assert!(s[0].closed && !s[1].closed);
        assert_eq!(s[1].start_line, 4);
    }

    #[test]
    fn names_are_whole_words() {
        assert_eq!(anchor_name("    // ANCHOR: user_code", "ANCHOR:"), Some("user_code"));
        assert_eq!(anchor_name("// ANCHOR_END: user_code", "ANCHOR:"), None);
        assert_eq!(anchor_name("// ANCHOR_END:user-code x", "ANCHOR_END:"), Some("user-code"));
        assert_eq!(anchor_name("// ANCHOR: ", "ANCHOR:"), None);
        let s = spans("// ANCHOR: user_code_extra\nx\n// ANCHOR_END: user_code_extra\n", "user_code");
        assert!(s.is_empty());
    }

    #[test]
    fn a_continuation_joins_its_span_without_a_gap_and_keeps_the_nesting() {
        // A loop with a timer line cut out: the pieces read as one loop, indented as in the source.
        let text = "fn f() {\n    // ANCHOR: u\n    for b in xs {\n        fwd(b);\n        // ANCHOR_END: u\n        timer.lap();\n        \
                    // ANCHOR: u (continued)\n        bwd(b);\n    }\n    // ANCHOR_END: u\n    report();\n    // ANCHOR: u\n    cleanup();\n    \
                    // ANCHOR_END: u\n}\n";
        let s = spans(text, "u");
        assert_eq!(s.iter().map(|s| s.continues).collect::<Vec<_>>(), [false, true, false]);
        assert_eq!(joined_dedented(&s), ["for b in xs {", "    fwd(b);", "    bwd(b);", "}", "", "cleanup();"]);
        // Without the marker, the same cut is two pieces: a blank line in the middle of the loop.
        let plain = text.replace(" (continued)", "");
        assert_eq!(joined_dedented(&spans(&plain, "u"))[..5], ["for b in xs {", "    fwd(b);", "", "    bwd(b);", "}"]);
        assert!(is_continuation("  // ANCHOR: user_code (continued)") && !is_continuation("// ANCHOR: user_code"));
        assert_eq!(anchor_name("// ANCHOR: user_code (continued)", "ANCHOR:"), Some("user_code"));
    }

    #[test]
    fn dedent_joins_spans() {
        let text = "    // ANCHOR: u\n    a\n\n      b\n    // ANCHOR_END: u\n// ANCHOR: u\n  c\n// ANCHOR_END: u\n";
        assert_eq!(joined_dedented(&spans(text, "u")), vec!["a", "", "  b", "", "c"]);
    }
}
