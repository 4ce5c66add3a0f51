//! What reaches the launcher's terminal: the line prefixer every rank's output goes through,
//! and the environment contract that lets a rank draw a progress bar there.
//!
//! # The prefixer
//!
//! A rank's output is cut into lines and each is written whole, after the rank's tag
//! (`[rank0]: `), so that ranks never interleave within a line. A progress bar (tqdm's,
//! indicatif's) redraws one line in place with a carriage return and writes no newline until it
//! ends: a write that holds a `\r` is passed through as it arrives — the tag is written again
//! after every `\r` — instead of waiting for a newline that would come only at the end.
//!
//! # The terminal contract: [`TTY_COLUMNS_VAR`]
//!
//! When the launcher's stdout is a terminal, it sets `LADDER_TTY_COLUMNS` for the ranks to the
//! columns a rank's line has there (the terminal's width less the rank's tag), though the rank's
//! own stdout is a pipe. A program that draws a bar when its stdout is a terminal (level 3's
//! Trainer, on rank 0) draws it there too, with carriage returns, at most that wide.

use std::io::{IsTerminal, Read};

/// Set by `ladder-run` (and `ladder-accelerate launch`) for every rank when the launcher's
/// stdout is a terminal: the columns left on a line for what the rank writes to stdout, after
/// the launcher's `[rank{r}]: ` prefix. Unset when the output goes to a file or a pipe.
pub const TTY_COLUMNS_VAR: &str = "LADDER_TTY_COLUMNS";

/// Narrower than this, a line has no room for a bar: the variable is not set.
const MIN_COLUMNS: u16 = 20;

/// The columns this process's stdout has on a launcher's terminal ([`TTY_COLUMNS_VAR`]), or
/// `None` when it is not set, not a number, or narrower than 20 columns. A program draws a
/// progress bar with carriage returns (never cursor moves up) when this is `Some`.
pub fn tty_columns() -> Option<u16> {
    parse_columns(std::env::var(TTY_COLUMNS_VAR).ok().as_deref())
}

fn parse_columns(value: Option<&str>) -> Option<u16> {
    value?.trim().parse::<u16>().ok().filter(|c| *c >= MIN_COLUMNS)
}

/// What the top launcher passes on as [`TTY_COLUMNS_VAR`]: its terminal's width when its own
/// stdout is a terminal, else what it inherited (a launcher under another launcher's prefixer),
/// else nothing.
pub(super) fn launcher_columns() -> Option<u16> {
    let stdout = std::io::stdout();
    if stdout.is_terminal() {
        return terminal_size::terminal_size_of(&stdout).map(|(w, _)| w.0).filter(|w| *w >= MIN_COLUMNS);
    }
    tty_columns()
}

/// What a rank worker passes on to PROGRAM as [`TTY_COLUMNS_VAR`], given what the launcher set
/// (`inherited`) and the tag the worker writes before each line: the columns left after the
/// tag, or `None` (the variable is removed) when the launcher set none or too few are left.
pub(super) fn columns_after_tag(inherited: Option<&str>, tag: &str) -> Option<u16> {
    let left = parse_columns(inherited)?.saturating_sub(tag.chars().count() as u16);
    (left >= MIN_COLUMNS).then_some(left)
}

/// The line prefixer's state for one stream: feed it what was read, write what it returns.
#[derive(Debug)]
pub(super) struct Prefixer {
    tag: Vec<u8>,
    /// Bytes of a line not written yet (no `\n` or `\r` seen since).
    pending: Vec<u8>,
    /// Whether part of the current line was written already (its tag included): the rest
    /// follows without a tag.
    open: bool,
    /// Whether redraws are under way: a `\r` was read, and no read since ended a plain line.
    /// A write can reach this reader in two reads (the bar drawn after a line above it): the
    /// unfinished rest is passed through all the same.
    in_place: bool,
}

impl Prefixer {
    /// A prefixer writing `tag` before every line (and after every `\r`).
    pub(super) fn new(tag: &str) -> Self {
        Self { tag: tag.as_bytes().to_vec(), pending: Vec::new(), open: false, in_place: false }
    }

    /// Takes `chunk`, as read from the stream, and returns what to write: every line it
    /// completes, with its tag; and while redraws are under way (`chunk`, or one read before it
    /// with no plain line since, holds a `\r`) or part of the line was written already, the
    /// unfinished rest too. `on_line` sees each complete
    /// line (ending in `\n`, without the tag) first and returns false to drop it (the
    /// launcher's own marker lines).
    pub(super) fn feed(&mut self, chunk: &[u8], on_line: &mut dyn FnMut(&[u8]) -> bool) -> Vec<u8> {
        let redraw = chunk.contains(&b'\r');
        self.in_place = redraw || (self.in_place && !chunk.ends_with(b"\n"));
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(i) = self.pending[start..].iter().position(|b| *b == b'\n' || *b == b'\r') {
            let end = start + i;
            let segment = &self.pending[start..=end];
            let whole_line = !self.open && segment.ends_with(b"\n");
            if !whole_line || on_line(segment) {
                // A bare `\r` at the start of a line has nothing to prefix.
                if !self.open && segment != b"\r" {
                    out.extend_from_slice(&self.tag);
                }
                out.extend_from_slice(segment);
            }
            self.open = false;
            start = end + 1;
        }
        self.pending.drain(..start);
        if !self.pending.is_empty() && (self.in_place || self.open) {
            if !self.open {
                out.extend_from_slice(&self.tag);
            }
            out.append(&mut self.pending);
            self.open = true;
        }
        out
    }

    /// At the end of the stream: the unfinished line, if any, ended with a newline.
    pub(super) fn finish(&mut self, on_line: &mut dyn FnMut(&[u8]) -> bool) -> Vec<u8> {
        if self.pending.is_empty() && !self.open {
            return Vec::new();
        }
        let mut out = Vec::new();
        self.pending.push(b'\n');
        if self.open || on_line(&self.pending) {
            if !self.open {
                out.extend_from_slice(&self.tag);
            }
            out.append(&mut self.pending);
        }
        self.pending.clear();
        self.open = false;
        out
    }
}

/// Reads `stream` to its end through `prefixer`, handing `write` what is to be written after
/// every read (a redraw as soon as it arrives) and `on_line` each complete line.
pub(super) fn pump(mut stream: impl Read, prefixer: &mut Prefixer, on_line: &mut dyn FnMut(&[u8]) -> bool, write: &mut dyn FnMut(&[u8])) {
    let mut buf = [0u8; 8192];
    loop {
        let n = match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let out = prefixer.feed(&buf[..n], on_line);
        if !out.is_empty() {
            write(&out);
        }
    }
    let out = prefixer.finish(on_line);
    if !out.is_empty() {
        write(&out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&str]) -> String {
        let mut p = Prefixer::new("[rank0]: ");
        let mut out = Vec::new();
        for c in chunks {
            out.extend(p.feed(c.as_bytes(), &mut |_| true));
        }
        out.extend(p.finish(&mut |_| true));
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn lines_are_written_whole_with_their_tag() {
        assert_eq!(run(&["a\nb\n"]), "[rank0]: a\n[rank0]: b\n");
        assert_eq!(run(&["par", "tial\nnext"]), "[rank0]: partial\n[rank0]: next\n");
        assert_eq!(run(&["\n"]), "[rank0]: \n");
        assert_eq!(run(&[]), "");
        // Nothing is written before the line is complete.
        let mut p = Prefixer::new("[rank1]: ");
        assert!(p.feed(b"half a line", &mut |_| true).is_empty());
        assert_eq!(p.feed(b"\n", &mut |_| true), b"[rank1]: half a line\n");
    }

    #[test]
    fn carriage_return_redraws_pass_through_at_once_with_the_tag_after_each_return() {
        let mut p = Prefixer::new("[rank0]: ");
        let mut feed = |s: &str| String::from_utf8(p.feed(s.as_bytes(), &mut |_| true)).unwrap();
        assert_eq!(feed("banner\n"), "[rank0]: banner\n");
        // indicatif's first draw, then two redraws: each at once, the tag after every `\r`.
        assert_eq!(feed("\r 10%|█   | 1/10"), "\r[rank0]:  10%|█   | 1/10");
        assert_eq!(feed("\x1b[2K\r 20%|██  | 2/10"), "\x1b[2K\r[rank0]:  20%|██  | 2/10");
        // A line printed above the bar (bar.println), then the bar again after the newline.
        assert_eq!(feed("\x1b[2K\r{'loss': 0.3}\n 30%|███ | 3/10"), "\x1b[2K\r[rank0]: {'loss': 0.3}\n[rank0]:  30%|███ | 3/10");
        // The rest of an open line follows without a tag; the bar's end closes it.
        // A redraw read in two pieces: the bar after the line above it comes through at once.
        assert_eq!(feed("\x1b[2K\r{'loss': 0.2}\n"), "\x1b[2K\r[rank0]: {'loss': 0.2}\n");
        assert_eq!(feed(" 40%|███▉| 4/10"), "[rank0]:  40%|███▉| 4/10");
        assert_eq!(feed(" done"), " done");
        assert_eq!(feed("\n"), "\n");
        // A plain line ends the redraws: a line is written whole again.
        assert_eq!(feed("after\n"), "[rank0]: after\n");
        assert_eq!(feed("half"), "");
        assert_eq!(feed(" line\n"), "[rank0]: half line\n");
    }

    #[test]
    fn a_bar_left_open_at_the_end_gets_its_newline() {
        assert_eq!(run(&["\r100%|████| 10/10"]), "\r[rank0]: 100%|████| 10/10\n");
    }

    #[test]
    fn marker_lines_are_offered_whole_and_can_be_dropped() {
        let mut p = Prefixer::new("");
        let mut seen = Vec::new();
        let mut keep = |l: &[u8]| {
            seen.push(String::from_utf8_lossy(l).into_owned());
            !l.starts_with(b"@@")
        };
        let mut out = p.feed(b"one\n@@marker 1\n\rbar", &mut keep);
        out.extend(p.finish(&mut keep));
        assert_eq!(String::from_utf8(out).unwrap(), "one\n\rbar\n");
        // The bar's pieces are not lines: only whole lines are offered.
        assert_eq!(seen, ["one\n", "@@marker 1\n"]);
    }

    /// The contract: the launcher's columns less the tag, none when unset, not a number, or
    /// too narrow for a bar.
    #[test]
    fn the_columns_passed_on_are_the_launchers_less_the_tag() {
        assert_eq!(columns_after_tag(Some("120"), "[rank0]: "), Some(111));
        assert_eq!(columns_after_tag(Some("120"), ""), Some(120));
        assert_eq!(columns_after_tag(Some(" 80\n"), "[rank10]: "), Some(70));
        assert_eq!(columns_after_tag(None, "[rank0]: "), None);
        assert_eq!(columns_after_tag(Some("wide"), "[rank0]: "), None);
        assert_eq!(columns_after_tag(Some("28"), "[rank0]: "), None);
        assert_eq!(columns_after_tag(Some("0"), ""), None);
        assert_eq!(parse_columns(Some("19")), None);
        assert_eq!(parse_columns(Some("20")), Some(20));
    }
}
