//! Writing a file so that no reader — another rank, the bench — ever sees half of it: a
//! temporary file in the same directory, synced, then renamed over the target (what PyTorch's
//! `torch.save` users and torchvision's downloads are advised to do).

use crate::{Error, Result};
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` atomically with mode 0644, creating missing parent directories.
///
/// # Errors
/// [`Error::Io`] naming the directory or the file that could not be written.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".ladder-")
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666)) // less the umask, as File::create
        .tempfile_in(dir)
        .map_err(|e| Error::io(dir, e))?;
    tmp.write_all(bytes).map_err(|e| Error::io(path, e))?;
    tmp.as_file().sync_all().map_err(|e| Error::io(path, e))?;
    tmp.persist(path).map_err(|e| Error::io(path, e.error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn writes_whole_file_readable_by_others_and_replaces_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("m.json");
        write_atomic(&path, b"first").unwrap();
        write_atomic(&path, b"second").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o644);
        // Nothing else is left in the directory.
        assert_eq!(std::fs::read_dir(path.parent().unwrap()).unwrap().count(), 1);
        // A parent that is a file: an Io error naming it.
        let bad = dir.path().join("sub").join("m.json").join("x.json");
        let err = write_atomic(&bad, b"x").unwrap_err().to_string();
        assert!(err.starts_with(&path.display().to_string()), "{err}");
    }
}
