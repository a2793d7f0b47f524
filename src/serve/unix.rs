//! The ext_proc server's Unix socket (`server.grpc_unix_socket`): for an Envoy on the same host
//! or in the same pod, a Unix socket costs both sides less per message than loopback TCP
//! (docs/envoy.md measures it).
//!
//! The socket file is kvrouter's own: a stale one (a socket nobody answers on, left by a
//! process that died) is replaced at start; a path that holds anything else, or a socket
//! another process still serves on (or that does not answer within a second), is an error
//! rather than something to delete. The file is made group-writable (0660: Envoy may run as
//! another user of the same group; nobody else can connect), and removed at shutdown if it is
//! still the one kvrouter bound. Put it in a directory only kvrouter (and Envoy) can write, as
//! `/run/kvrouter` in the sidecar overlay: until the mode is set the socket has the umask's
//! mode, and whoever can write the directory can replace the file.

use std::io::ErrorKind;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};

use crate::extproc::UnixIncoming;

/// The socket file's mode: owner and group may connect.
const MODE: u32 = 0o660;

/// How long the probe of an existing socket file may wait for an answer.
const PROBE: Duration = Duration::from_secs(1);

/// How long the accept loop waits after a failed accept (no file descriptors left, say)
/// before trying again, so a lasting error does not spin a worker.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// Removes the socket file when dropped, if it is still the file [`bind`] created.
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    /// Device and inode of the file bound.
    id: (u64, u64),
    /// On Linux, a path-only descriptor of that file, held so that its inode number cannot be
    /// given to a file put in its place while kvrouter runs.
    _pin: Option<std::fs::File>,
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let ours =
            std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.id);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A path-only descriptor of the socket file at `path` (not following a symlink).
#[cfg(target_os = "linux")]
fn pin(path: &Path) -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW)
        .open(path)
        .ok()
}

#[cfg(not(target_os = "linux"))]
fn pin(_: &Path) -> Option<std::fs::File> {
    None
}

/// Binds a listening Unix socket at `path`, replacing a stale socket file there; its
/// connections as a stream for the ext_proc server, and the file.
pub async fn bind(path: &Path) -> anyhow::Result<(UnixIncoming, SocketFile)> {
    let what = || format!("{} (server.grpc_unix_socket)", path.display());
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            bail!("{} exists and is not a socket; not replacing it", what())
        }
        Ok(_) => match tokio::time::timeout(PROBE, tokio::net::UnixStream::connect(path)).await {
            Ok(Err(e)) if e.kind() == ErrorKind::ConnectionRefused => {
                std::fs::remove_file(path)
                    .with_context(|| format!("cannot remove the stale socket {}", what()))?;
            }
            Ok(Ok(_)) => bail!("another process is serving on {}", what()),
            // A listener whose backlog is full: alive, if slow.
            Ok(Err(e)) if e.kind() == ErrorKind::WouldBlock => {
                bail!("another process is listening on {} (busy)", what())
            }
            Ok(Err(e)) => bail!("cannot tell whether {} is in use: {e}", what()),
            Err(_) => bail!("another process is listening on {} (not answering)", what()),
        },
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => bail!("cannot inspect {}: {e}", what()),
    }
    let listener = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("cannot listen on {}", what()))?;
    let meta = std::fs::symlink_metadata(path).with_context(what)?;
    if !meta.file_type().is_socket() {
        bail!("{} was replaced while binding", what());
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(MODE))
        .with_context(|| format!("cannot set the mode of {}", what()))?;
    let file = SocketFile {
        path: path.to_path_buf(),
        id: (meta.dev(), meta.ino()),
        _pin: pin(path),
    };
    Ok((incoming(listener), file))
}

/// The connections `listener` accepts.
fn incoming(listener: tokio::net::UnixListener) -> UnixIncoming {
    Box::pin(futures::stream::unfold(listener, |listener| async move {
        match listener.accept().await {
            Ok((stream, _)) => Some((Ok(stream), listener)),
            Err(e) => {
                tracing::warn!("accept on the ext_proc Unix socket failed: {e}");
                tokio::time::sleep(ACCEPT_RETRY).await;
                Some((Err(e), listener))
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stale_socket_is_replaced_and_the_file_removed_at_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("grpc.sock");
        // A socket file nobody serves on: what a killed kvrouter leaves.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let (mut incoming, file) = bind(&path).await.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, MODE);
        // It accepts.
        let client = tokio::net::UnixStream::connect(&path);
        let (accepted, connected) = tokio::join!(futures::StreamExt::next(&mut incoming), client);
        accepted.expect("a connection").unwrap();
        connected.unwrap();
        drop(incoming);
        drop(file);
        assert!(!path.exists(), "the socket file is removed at the end");
    }

    #[tokio::test]
    async fn a_served_socket_and_a_regular_file_are_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let served = dir.path().join("served.sock");
        let _other = std::os::unix::net::UnixListener::bind(&served).unwrap();
        let e = bind(&served).await.err().expect("refused").to_string();
        assert!(e.contains("another process is serving"), "{e}");
        assert!(served.exists());

        let file = dir.path().join("notes.txt");
        std::fs::write(&file, "keep me").unwrap();
        let e = bind(&file).await.err().expect("refused").to_string();
        assert!(e.contains("is not a socket"), "{e}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
    }

    #[tokio::test]
    async fn a_file_put_in_its_place_is_not_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("grpc.sock");
        let (incoming, file) = bind(&path).await.unwrap();
        drop(incoming);
        // Another instance took the path over meanwhile.
        std::fs::remove_file(&path).unwrap();
        let _theirs = std::os::unix::net::UnixListener::bind(&path).unwrap();
        drop(file);
        assert!(path.exists(), "another process's socket stays");
    }
}
