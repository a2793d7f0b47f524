//! Several replicas in one process, each on its own port with its own engine task.

use super::config::FleetConfig;
use super::http::{serve, RunningReplica};
use super::replica::SimError;

/// A started fleet.
#[derive(Debug)]
pub struct Fleet {
    /// The replicas, in the fleet file's order.
    pub replicas: Vec<RunningReplica>,
}

impl Fleet {
    /// Starts every replica of `config`; on the first failure, stops those already started and
    /// returns the error with the replica's name.
    pub async fn start(config: FleetConfig) -> Result<Fleet, (String, SimError)> {
        let errors = config.validate();
        if !errors.is_empty() {
            return Err(("fleet".into(), SimError::Config(errors)));
        }
        let mut replicas = Vec::with_capacity(config.replicas.len());
        for replica in config.replicas {
            let name = replica.name.clone();
            match serve(replica).await {
                Ok(running) => replicas.push(running),
                Err(e) => {
                    for r in replicas {
                        r.shutdown().await;
                    }
                    return Err((name, e));
                }
            }
        }
        Ok(Fleet { replicas })
    }

    /// Stops every replica (open responses are given the chance to finish).
    pub async fn shutdown(self) {
        futures::future::join_all(self.replicas.into_iter().map(RunningReplica::shutdown)).await;
    }
}
