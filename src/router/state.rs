//! [`RouterState`]: everything a decision reads that a config reload replaces, as one immutable
//! snapshot, and the cell that publishes it.
//!
//! A request takes the snapshot once, when its routing starts ([`super::Router::snapshot`]), and
//! every later step reads that same value: the body limit, the tenant header, the candidates'
//! health thresholds, the policy, the destination header, and, once routed, the breaker and
//! learning settings its response is judged by. A reload in the middle of a request therefore
//! cannot split one decision across two configs; it applies from the next request on.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::sync::watch;

use super::ApplyError;
use crate::config::{Config, KvTiersConfig, DEFAULT_KV_BYTES_PER_TOKEN};
use crate::policy::cost::CostModel;
use crate::policy::{self, Policy};
use crate::prefix::{TenantSalts, TokenizerRegistry};

/// Prompt bodies larger than this are decided on the blocking pool whatever the config: parsing
/// them alone takes long enough to stall an async worker.
const SLOW_BODY_BYTES: usize = 256 * 1024;

/// The parts of the router rebuilt on every config reload, read together by one request.
#[derive(Debug)]
pub struct RouterState {
    /// The config in force.
    pub config: Arc<Config>,
    /// The policy it names.
    pub policy: Arc<dyn Policy>,
    /// Tokenizers per model.
    pub tokenizers: Arc<TokenizerRegistry>,
    /// Tenant -> namespace salt and engine `cache_salt`, and the header naming the tenant.
    pub tenants: TenantSalts,
    /// The cost model's constants (`policy.predicted_ttft`), for the TTFT a pick is expected to
    /// show.
    pub(crate) cost: CostModel,
    /// Some model is tokenized: a decision may take long enough for the blocking pool.
    tokenizing: bool,
    /// Some pool subscribes to KV events: candidates' cache sources are worth asking about.
    kv_events: bool,
    /// Every pool of the config -> the tenants it admits, when it lists them
    /// (`pools[].tenants`); `None`: open to all.
    pools: HashMap<String, Option<HashSet<String>>>,
    /// Pool name -> its tiers' load speeds (`pools[].kv_tiers`). Looked up for every candidate
    /// of every decision: a fast hash (pool names come from the config, not from clients).
    kv_tiers: HashMap<String, KvTiersConfig, ahash::RandomState>,
    /// Model name -> KV bytes per token (`models[]`); models without an entry take the default.
    kv_bytes_per_token: HashMap<String, u64>,
}

impl RouterState {
    /// The state for `config`, reusing `previous`'s tokenizers (and warm token caches) when the
    /// models did not change and its policy (and tie-break state) when the policy did not.
    /// Relative tokenizer paths resolve against `base_dir`.
    pub(crate) fn build(
        config: Config,
        base_dir: &Path,
        previous: Option<&RouterState>,
    ) -> Result<RouterState, ApplyError> {
        let tokenizers = match previous {
            Some(old) if old.config.models == config.models => Arc::clone(&old.tokenizers),
            Some(old) => Arc::new(old.tokenizers.rebuild(&config.models, base_dir)?),
            None => Arc::new(TokenizerRegistry::from_config(&config.models, base_dir)?),
        };
        let policy = match previous {
            Some(old) if old.config.policy == config.policy => Arc::clone(&old.policy),
            _ => policy::build(&config.policy),
        };
        Ok(RouterState {
            tenants: TenantSalts::from_config(&config.tenancy, base_dir)?,
            cost: CostModel::from(&config.policy.predicted_ttft),
            tokenizing: config.models.iter().any(|m| m.tokenizer.is_some()),
            // Discovered pools subscribe per endpoint as endpoints appear.
            kv_events: !config.kv_event_subscriptions().is_empty()
                || config
                    .pools
                    .iter()
                    .any(|p| p.kv_events.is_some() && (p.dns.is_some() || p.kubernetes.is_some())),
            pools: config
                .pools
                .iter()
                .map(|p| {
                    let tenants =
                        (!p.tenants.is_empty()).then(|| p.tenants.iter().cloned().collect());
                    (p.name.clone(), tenants)
                })
                .collect(),
            kv_tiers: config
                .pools
                .iter()
                .map(|p| (p.name.clone(), p.kv_tiers))
                .collect(),
            kv_bytes_per_token: config
                .models
                .iter()
                .map(|m| (m.name.clone(), m.kv_bytes_per_token()))
                .collect(),
            config: Arc::new(config),
            policy,
            tokenizers,
        })
    }

    /// Whether deciding a body of `body_len` bytes may take long enough (tokenizing, or a huge
    /// body) that it belongs on the blocking pool rather than an async worker.
    pub fn decides_slowly(&self, body_len: usize) -> bool {
        body_len > SLOW_BODY_BYTES || self.tokenizing
    }

    /// Whether a request of `tenant` (none: no trusted tenant) may go to endpoints of `pool`:
    /// yes unless the pool lists its tenants and this is not one of them, or this snapshot's
    /// config has no such pool (one a reload added while the request was read: whom it
    /// admits is the new config's to say, so not this request).
    pub fn pool_admits(&self, pool: &str, tenant: Option<&str>) -> bool {
        match self.pools.get(pool) {
            None => false,
            Some(None) => true,
            Some(Some(tenants)) => tenant.is_some_and(|t| tenants.contains(t)),
        }
    }

    /// Whether this snapshot's config has a pool named `pool`.
    pub fn knows_pool(&self, pool: &str) -> bool {
        self.pools.contains_key(pool)
    }

    /// The load speeds of `pool`'s slower KV tiers (the defaults for a pool not in the config).
    pub fn kv_tiers(&self, pool: &str) -> KvTiersConfig {
        self.kv_tiers.get(pool).copied().unwrap_or_default()
    }

    /// Bytes of KV a token of `model` takes.
    pub fn kv_bytes_per_token(&self, model: &str) -> u64 {
        self.kv_bytes_per_token
            .get(model)
            .copied()
            .unwrap_or(DEFAULT_KV_BYTES_PER_TOKEN)
    }

    /// Whether any pool subscribes to KV events (else every endpoint's cache source is
    /// predictions and nothing need be asked per candidate).
    pub(crate) fn kv_events(&self) -> bool {
        self.kv_events
    }
}

/// The snapshot in force. Requests load it lock-free; a reload swaps it whole, and also
/// publishes the new config to background watchers (the monitor, the EDS writer) that follow
/// changes rather than read per request.
#[derive(Debug)]
pub(crate) struct StateCell {
    current: ArcSwap<RouterState>,
    config: watch::Sender<Arc<Config>>,
    /// The config file's directory: where relative tokenizer paths resolve.
    base_dir: PathBuf,
}

impl StateCell {
    pub(crate) fn new(state: RouterState, base_dir: &Path) -> StateCell {
        StateCell {
            config: watch::Sender::new(Arc::clone(&state.config)),
            current: ArcSwap::from_pointee(state),
            base_dir: base_dir.to_path_buf(),
        }
    }

    /// The snapshot in force: one atomic load and a reference count.
    pub(crate) fn load(&self) -> Arc<RouterState> {
        self.current.load_full()
    }

    /// The state `config` calls for, built against the one in force (nothing published yet).
    pub(crate) fn next(&self, config: Config) -> Result<RouterState, ApplyError> {
        RouterState::build(config, &self.base_dir, Some(&self.current.load()))
    }

    /// Puts `state` in force.
    pub(crate) fn store(&self, state: RouterState) -> Arc<RouterState> {
        let state = Arc::new(state);
        self.current.store(Arc::clone(&state));
        self.config.send_replace(Arc::clone(&state.config));
        state
    }

    /// The config in force, following reloads.
    pub(crate) fn watch_config(&self) -> watch::Receiver<Arc<Config>> {
        self.config.subscribe()
    }
}
