//! A small TCP key-value store for the rendezvous, as `torch.distributed.TCPStore`: rank 0
//! serves it at `MASTER_ADDR:MASTER_PORT`, every rank (rank 0 included) connects to it, checks
//! in with its rank, and then exchanges byte values by key — NCCL's unique id, above all.
//!
//! Wire format (private to this module): every request is an opcode byte followed by
//! length-prefixed fields (`u32` big-endian length + bytes) and `u64` big-endian numbers; every
//! reply is a status byte (`0` ok, `1` error) and one length-prefixed field (the value or the
//! error message). The check-in carries a magic word so that a stray server on the port is
//! reported as such instead of misread.

use super::env::DistEnv;
use crate::{Error, Result};
use std::collections::{BTreeSet, HashMap};
use std::io::{BufReader, BufWriter, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MAGIC: u64 = 0x4c41_4444_4552_5331; // "LADDERS1"
const OP_CHECKIN: u8 = 1;
const OP_SET: u8 = 2;
const OP_GET: u8 = 3;
const MAX_FIELD: u32 = 256 << 20; // 256 MiB: far above any id, well below a bad length
const GRACE: Duration = Duration::from_secs(2);

/// A client of the rendezvous store (and, on rank 0, the store itself).
///
/// Every method takes `&self`; requests from several threads are serialised.
#[derive(Debug)]
pub struct TcpStore {
    conn: Mutex<Conn>,
    addr: String,
    rank: usize,
    timeout: Duration,
    server: Option<Server>,
}

#[derive(Debug)]
struct Conn {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
}

impl TcpStore {
    /// Joins the rendezvous described by `env`: rank 0 binds `MASTER_ADDR:MASTER_PORT` and
    /// serves the store from a thread; every rank connects (retrying until `timeout`), checks in
    /// with its rank, and returns once all `world_size` ranks have checked in.
    ///
    /// Rank 0 binds the address `MASTER_ADDR` resolves to when that is a loopback address
    /// (one node), and otherwise every interface of that family, as `TCPStore` does, so that
    /// other nodes can reach it. `timeout` also bounds every later [`TcpStore::get`].
    ///
    /// # Errors
    /// [`Error::Env`] when `env.master_port` is `None`; [`Error::Rendezvous`] naming
    /// `addr:port` when: the port is in use (rank 0), the address does not resolve, the store
    /// cannot be reached within `timeout`, the ranks listed as missing never checked in within
    /// `timeout`, two processes claimed the same rank (naming it), the ranks disagree on the
    /// world size, or something other than a `TcpStore` answers on the port.
    pub fn connect(env: &DistEnv, timeout: Duration) -> Result<TcpStore> {
        let port = env.master_port.ok_or_else(|| {
            Error::Env(format!(
                "MASTER_PORT is not set (rank {} of {}); the TCP rendezvous needs MASTER_ADDR:MASTER_PORT, as ladder-run or torchrun set them",
                env.rank, env.world_size
            ))
        })?;
        let addr = format!("{}:{port}", env.master_addr);
        let err = |problem: String| Error::Rendezvous { addr: addr.clone(), problem };
        let deadline = Instant::now() + timeout;
        let targets: Vec<SocketAddr> = (env.master_addr.as_str(), port)
            .to_socket_addrs()
            .map_err(|e| err(format!("cannot resolve {:?}: {e}", env.master_addr)))?
            .collect();
        if targets.is_empty() {
            return Err(err(format!("{:?} resolves to no address", env.master_addr)));
        }
        let server = if env.rank == 0 { Some(Server::start(&targets, env.world_size, &addr)?) } else { None };

        // Connect, retrying while rank 0 is not up yet.
        let stream = loop {
            let mut last_err = None;
            let mut connected = None;
            for t in &targets {
                let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
                match TcpStream::connect_timeout(t, left.min(Duration::from_secs(1))) {
                    Ok(s) => {
                        connected = Some(s);
                        break;
                    }
                    Err(e) => last_err = Some(e),
                }
            }
            if let Some(s) = connected {
                break s;
            }
            if Instant::now() >= deadline {
                let last = last_err.map(|e| e.to_string()).unwrap_or_default();
                return Err(err(format!(
                    "rank {} could not reach the store within {timeout:?}: rank 0, which serves it, never came up (last error: {last})",
                    env.rank
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let _ = stream.set_nodelay(true);
        let write_half = stream.try_clone().map_err(|e| err(format!("socket: {e}")))?;
        let store = TcpStore {
            conn: Mutex::new(Conn { reader: BufReader::new(stream), writer: BufWriter::new(write_half) }),
            addr: addr.clone(),
            rank: env.rank,
            timeout,
            server,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let mut req = vec![OP_CHECKIN];
        put_u64(&mut req, MAGIC);
        put_u64(&mut req, env.rank as u64);
        put_u64(&mut req, env.world_size as u64);
        put_u64(&mut req, left.as_millis() as u64);
        store.request(&req, left, "check-in")?;
        Ok(store)
    }

    /// Stores `value` under `key` (overwriting), as `TCPStore.set`.
    ///
    /// # Errors
    /// [`Error::Rendezvous`] when the store is unreachable (rank 0 gone).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut req = vec![OP_SET];
        put_bytes(&mut req, key.as_bytes());
        put_bytes(&mut req, value);
        self.request(&req, self.timeout, &format!("set {key:?}")).map(|_| ())
    }

    /// The value under `key`, waiting until some rank sets it, as `TCPStore.get`.
    ///
    /// # Errors
    /// [`Error::Rendezvous`] naming `key` when it is not set within the store's timeout, or
    /// when the store is unreachable.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let mut req = vec![OP_GET];
        put_bytes(&mut req, key.as_bytes());
        put_u64(&mut req, self.timeout.as_millis() as u64);
        self.request(&req, self.timeout, &format!("get {key:?}"))
    }

    /// The rank this store was joined as.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Sends one request and reads its reply; `wait` is how long the server may take.
    fn request(&self, req: &[u8], wait: Duration, what: &str) -> Result<Vec<u8>> {
        let err = |problem: String| Error::Rendezvous { addr: self.addr.clone(), problem };
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let io = |e: std::io::Error| match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                err(format!("rank {}: {what}: no answer from the store within {:?}", self.rank, wait + GRACE))
            }
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
                err(format!("rank {}: {what}: the store closed the connection (did rank 0 exit?)", self.rank))
            }
            _ => err(format!("rank {}: {what}: {e}", self.rank)),
        };
        conn.writer.write_all(req).and_then(|_| conn.writer.flush()).map_err(io)?;
        conn.reader.get_ref().set_read_timeout(Some(wait + GRACE)).map_err(io)?;
        let mut status = [0u8; 1];
        conn.reader.read_exact(&mut status).map_err(io)?;
        let body = read_bytes(&mut conn.reader).map_err(io)?;
        match status[0] {
            0 => Ok(body),
            1 => Err(err(format!("rank {}: {what}: {}", self.rank, String::from_utf8_lossy(&body)))),
            s => Err(err(format!("rank {}: {what}: reply status {s} is not a TcpStore's; is another service using the port?", self.rank))),
        }
    }
}

impl Drop for TcpStore {
    /// Closes this rank's connection. On rank 0 it then waits (at most the store's timeout)
    /// until every other rank has closed its own, so that ranks still reading a value are not
    /// cut off, and stops the server.
    fn drop(&mut self) {
        if let Ok(conn) = self.conn.get_mut() {
            let _ = conn.reader.get_ref().shutdown(std::net::Shutdown::Both);
        }
        if let Some(server) = self.server.take() {
            server.stop(self.timeout);
        }
    }
}

// ---- server -------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct State {
    world_size: usize,
    checked_in: BTreeSet<usize>,
    /// A fatal problem every waiter is told about (a duplicate rank).
    failure: Option<String>,
    kv: HashMap<String, Vec<u8>>,
    open_connections: usize,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    stopping: AtomicBool,
}

#[derive(Debug)]
struct Server {
    shared: Arc<Shared>,
    local: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

impl Server {
    fn start(targets: &[SocketAddr], world_size: usize, addr: &str) -> Result<Server> {
        let t = targets[0];
        let bind = if t.ip().is_loopback() {
            t
        } else if t.is_ipv4() {
            SocketAddr::from(([0, 0, 0, 0], t.port()))
        } else {
            SocketAddr::from(([0u16; 8], t.port()))
        };
        let listener = TcpListener::bind(bind).map_err(|e| Error::Rendezvous {
            addr: addr.to_string(),
            problem: if e.kind() == ErrorKind::AddrInUse {
                format!(
                    "port in use: rank 0 cannot serve the store on {bind} because another process is listening there (a previous job, rank 0 started twice, or another service); pick a free MASTER_PORT"
                )
            } else {
                format!("rank 0 cannot listen on {bind}: {e}")
            },
        })?;
        let local = listener.local_addr().unwrap_or(bind);
        let shared = Arc::new(Shared {
            state: Mutex::new(State { world_size, ..State::default() }),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("tcpstore-accept".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if s.stopping.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let s2 = s.clone();
                    s.state.lock().unwrap_or_else(|p| p.into_inner()).open_connections += 1;
                    let spawned = std::thread::Builder::new().name("tcpstore-conn".into()).spawn(move || {
                        let _ = serve(&s2, conn);
                        s2.state.lock().unwrap_or_else(|p| p.into_inner()).open_connections -= 1;
                        s2.changed.notify_all();
                    });
                    if spawned.is_err() {
                        s.state.lock().unwrap_or_else(|p| p.into_inner()).open_connections -= 1;
                    }
                }
            })
            .map_err(|e| Error::Rendezvous { addr: addr.to_string(), problem: format!("cannot start the store thread: {e}") })?;
        Ok(Server { shared, local, accept: Some(accept) })
    }

    fn stop(mut self, patience: Duration) {
        let deadline = Instant::now() + patience;
        let mut st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        while st.open_connections > 0 && Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            st = self.shared.changed.wait_timeout(st, left.min(Duration::from_millis(100))).unwrap_or_else(|p| p.into_inner()).0;
        }
        drop(st);
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        // Wake the accept loop with a connection of our own.
        let wake = if self.local.ip().is_unspecified() {
            SocketAddr::new(
                if self.local.is_ipv4() { [127, 0, 0, 1].into() } else { std::net::Ipv6Addr::LOCALHOST.into() },
                self.local.port(),
            )
        } else {
            self.local
        };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

/// Serves one connection until it closes.
fn serve(s: &Shared, conn: TcpStream) -> std::io::Result<()> {
    let _ = conn.set_nodelay(true);
    let mut r = BufReader::new(conn.try_clone()?);
    let mut w = BufWriter::new(conn);
    let mut rank = None;
    loop {
        let mut op = [0u8; 1];
        match r.read_exact(&mut op) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        if s.stopping.load(Ordering::SeqCst) {
            return Ok(());
        }
        let reply: std::result::Result<Vec<u8>, String> = match op[0] {
            OP_CHECKIN => {
                if read_u64(&mut r)? != MAGIC {
                    return Ok(()); // not one of ours: hang up
                }
                let (r_rank, r_world, wait_ms) = (read_u64(&mut r)? as usize, read_u64(&mut r)? as usize, read_u64(&mut r)?);
                rank = Some(r_rank);
                checkin(s, r_rank, r_world, Duration::from_millis(wait_ms))
            }
            OP_SET if rank.is_some() => {
                let key = String::from_utf8_lossy(&read_bytes(&mut r)?).into_owned();
                let value = read_bytes(&mut r)?;
                s.state.lock().unwrap_or_else(|p| p.into_inner()).kv.insert(key, value);
                s.changed.notify_all();
                Ok(Vec::new())
            }
            OP_GET if rank.is_some() => {
                let key = String::from_utf8_lossy(&read_bytes(&mut r)?).into_owned();
                let wait = Duration::from_millis(read_u64(&mut r)?);
                get(s, &key, wait)
            }
            _ => return Ok(()), // protocol violation: hang up
        };
        match reply {
            Ok(v) => {
                w.write_all(&[0])?;
                let mut b = Vec::new();
                put_bytes(&mut b, &v);
                w.write_all(&b)?;
            }
            Err(m) => {
                w.write_all(&[1])?;
                let mut b = Vec::new();
                put_bytes(&mut b, m.as_bytes());
                w.write_all(&b)?;
            }
        }
        w.flush()?;
    }
}

fn checkin(s: &Shared, rank: usize, world: usize, wait: Duration) -> std::result::Result<Vec<u8>, String> {
    let deadline = Instant::now() + wait;
    let mut st = s.state.lock().unwrap_or_else(|p| p.into_inner());
    if world != st.world_size {
        return Err(format!(
            "rank {rank} has world size {world} but rank 0 has {}; every rank must see the same WORLD_SIZE",
            st.world_size
        ));
    }
    if rank >= st.world_size {
        return Err(format!("rank {rank} is outside 0..{}", st.world_size));
    }
    if !st.checked_in.insert(rank) {
        let msg = format!("duplicate rank {rank}: two processes checked in as rank {rank}; each rank must be started once");
        st.failure = Some(msg.clone());
        s.changed.notify_all();
        return Err(msg);
    }
    s.changed.notify_all();
    loop {
        if let Some(f) = &st.failure {
            return Err(f.clone());
        }
        if st.checked_in.len() == st.world_size {
            return Ok(Vec::new());
        }
        let now = Instant::now();
        if now >= deadline || s.stopping.load(Ordering::SeqCst) {
            let missing: Vec<usize> = (0..st.world_size).filter(|r| !st.checked_in.contains(r)).collect();
            return Err(format!(
                "timed out after {wait:?} waiting for ranks {missing:?} of world size {}; these ranks never checked in (arrived: {:?})",
                st.world_size, st.checked_in
            ));
        }
        st = s.changed.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
    }
}

fn get(s: &Shared, key: &str, wait: Duration) -> std::result::Result<Vec<u8>, String> {
    let deadline = Instant::now() + wait;
    let mut st = s.state.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if let Some(v) = st.kv.get(key) {
            return Ok(v.clone());
        }
        let now = Instant::now();
        if now >= deadline || s.stopping.load(Ordering::SeqCst) {
            return Err(format!("key {key:?} was not set within {wait:?}"));
        }
        st = s.changed.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
    }
}

// ---- framing ------------------------------------------------------------------------------

fn put_u64(buf: &mut Vec<u8>, v: u64) {
    buf.extend_from_slice(&v.to_be_bytes());
}

fn put_bytes(buf: &mut Vec<u8>, v: &[u8]) {
    buf.extend_from_slice(&(v.len() as u32).to_be_bytes());
    buf.extend_from_slice(v);
}

fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn read_bytes(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    let n = u32::from_be_bytes(b);
    if n > MAX_FIELD {
        return Err(std::io::Error::new(ErrorKind::InvalidData, format!("field of {n} bytes exceeds {MAX_FIELD}")));
    }
    let mut v = vec![0u8; n as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}
