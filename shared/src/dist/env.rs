// TEMPORARY stub until branch `launch` merges.
use crate::Result;
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv { pub rank: usize, pub local_rank: usize, pub world_size: usize, pub local_world_size: usize, pub master_addr: String, pub master_port: Option<u16>, pub launcher: Launcher }
#[derive(Debug, Clone, Copy, PartialEq, Eq)] pub enum Launcher { None, Torchrun, Mpirun }
impl DistEnv {
    pub fn from_env() -> Result<DistEnv> {
        let g = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
        if let (Some(r), Some(w)) = (g("OMPI_COMM_WORLD_RANK"), g("OMPI_COMM_WORLD_SIZE")) {
            return Ok(DistEnv { rank: r, local_rank: g("OMPI_COMM_WORLD_LOCAL_RANK").unwrap_or(r), world_size: w, local_world_size: g("OMPI_COMM_WORLD_LOCAL_SIZE").unwrap_or(w), master_addr: "127.0.0.1".into(), master_port: None, launcher: Launcher::Mpirun });
        }
        Ok(Self::single())
    }
    pub fn single() -> DistEnv { DistEnv { rank: 0, local_rank: 0, world_size: 1, local_world_size: 1, master_addr: "127.0.0.1".into(), master_port: None, launcher: Launcher::None } }
    pub fn under_mpirun(&self) -> bool { self.launcher == Launcher::Mpirun }
}
