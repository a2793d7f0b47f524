//! The whole path in one value for end-to-end tests: replicas, kvrouter (which writes the EDS
//! file) and Envoy, wired together in a temporary directory. Panics on failure, as tests want.

use std::net::SocketAddr;
use std::time::Duration;

use kvrouter::envoyconf::{self, BodyMode, ClusterStyle};

use crate::{
    envoy_options, eventually, post, router_config, router_config_with_pool, start_envoy,
    start_replica, start_router, Envoy, Replica, ReplicaSpec, Reply, Router,
};

/// Replicas + kvrouter + Envoy, wired together in a temporary directory (logs included).
pub struct Stack {
    /// The directory: configs, EDS file, one log per process.
    pub dir: tempfile::TempDir,
    /// The replicas, `r0`, `r1`, ...
    pub replicas: Vec<Replica>,
    /// kvrouter.
    pub router: Router,
    /// Envoy.
    pub envoy: Envoy,
    /// A client for the test's requests.
    pub client: reqwest::Client,
}

/// How to build a [`Stack`].
pub struct StackOptions<'a> {
    /// How many replicas. Default 3.
    pub replicas: usize,
    /// Extra router YAML (top-level sections other than `pools`, `server`, `envoy`).
    pub router_extra: &'a str,
    /// Extra fields of the router's one pool (see [`router_config_with_pool`]). Default none.
    pub pool_extra: &'a str,
    /// How Envoy routes to the pick. Default `OverrideHost`.
    pub cluster: ClusterStyle,
    /// How Envoy sends bodies to kvrouter. Default `Buffered`.
    pub body_mode: BodyMode,
    /// Include Envoy's response observer filter. Default true.
    pub observe: bool,
    /// Extra kvsim flags for every replica (`["--time-scale", "100"]`).
    pub replica_flags: &'a [&'a str],
    /// Replicas publish KV events and kvrouter subscribes to each. Default false.
    pub kv_events: bool,
    /// The tenancy header Envoy strips from clients (and sets from `jwt`). Default none.
    pub tenant_header: Option<&'a str>,
    /// Envoy's `jwt_authn` filter as the tenant's source. Default none.
    pub jwt: Option<envoyconf::JwtOptions>,
    /// Envoy's ext_proc message timeout, in ms (above kvrouter's `flow_control.max_wait_ms`
    /// when requests may queue). Default 2000.
    pub message_timeout_ms: u64,
    /// kvrouter also serves ext_proc on a Unix socket in the test's directory
    /// (`server.grpc_unix_socket`), and Envoy reaches it only there. Default false.
    pub unix_socket: bool,
}

impl Default for StackOptions<'_> {
    fn default() -> Self {
        StackOptions {
            replicas: 3,
            router_extra: "",
            pool_extra: "",
            cluster: ClusterStyle::OverrideHost,
            body_mode: BodyMode::Buffered,
            observe: true,
            replica_flags: &[],
            kv_events: false,
            tenant_header: None,
            jwt: None,
            message_timeout_ms: 2000,
            unix_socket: false,
        }
    }
}

impl Stack {
    /// Starts the replicas, then kvrouter (which writes the EDS file), then Envoy, and waits
    /// until Envoy knows every replica.
    pub async fn start(o: StackOptions<'_>) -> Stack {
        let dir = tempfile::tempdir().expect("tempdir");
        let replicas: Vec<Replica> = (0..o.replicas)
            .map(|i| {
                let mut spec = ReplicaSpec::new(format!("r{i}"));
                spec.flags = o.replica_flags.iter().map(|f| f.to_string()).collect();
                spec.kv_events = o.kv_events;
                start_replica(dir.path(), spec)
            })
            .collect();
        let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.addr).collect();
        let mut router_yaml =
            router_config_with_pool(dir.path(), &replicas, o.router_extra, o.pool_extra);
        if o.unix_socket {
            let line = format!(
                "server:\n  grpc_unix_socket: {}\n",
                dir.path().join("grpc.sock").display()
            );
            router_yaml = router_yaml.replacen("server:\n", &line, 1);
        }
        let router = start_router(dir.path(), &router_yaml);
        let static_replicas = (o.cluster == ClusterStyle::OriginalDst).then(|| addrs.clone());
        let extproc = if o.unix_socket {
            let path = router.grpc_unix.clone();
            envoyconf::ExtprocAddress::Unix(path.expect("kvrouter announces its Unix socket"))
        } else {
            router.grpc.into()
        };
        let options = envoyconf::EnvoyOptions {
            extproc,
            observe: o.observe,
            tenant_header: o.tenant_header.map(str::to_string),
            jwt: o.jwt.clone(),
            message_timeout_ms: o.message_timeout_ms,
            ..envoy_options(&router, dir.path(), o.cluster, o.body_mode, static_replicas)
        };
        let envoy = start_envoy(dir.path(), &envoyconf::render(&options)).await;
        envoy.wait_for_hosts(&addrs).await.unwrap();
        Stack {
            dir,
            replicas,
            router,
            envoy,
            client: reqwest::Client::new(),
        }
    }

    /// POSTs through Envoy.
    pub async fn post(&self, path: &str, body: String) -> Reply {
        post(&self.client, self.envoy.addr, path, body).await
    }

    /// kvrouter's live explanation for the request `body` (`/debug/explain`; routes nothing).
    pub async fn explain(&self, body: &str) -> serde_json::Value {
        self.client
            .post(format!("http://{}/debug/explain", self.router.admin))
            .body(body.to_string())
            .send()
            .await
            .expect("explain")
            .json()
            .await
            .expect("explain json")
    }

    /// The replica name served at `addr`.
    pub fn name_of(&self, addr: &str) -> Option<&str> {
        self.replicas
            .iter()
            .find(|r| r.addr.to_string() == addr)
            .map(|r| r.name.as_str())
    }

    /// The router's endpoint table (`/debug/endpoints`).
    pub async fn endpoint_table(&self) -> serde_json::Value {
        self.client
            .get(format!("http://{}/debug/endpoints", self.router.admin))
            .send()
            .await
            .expect("debug endpoints")
            .json()
            .await
            .expect("json")
    }

    /// Replaces the router's config with `yaml` (hot reload) and waits until the router has
    /// published a new endpoint set.
    pub async fn reload(&self, yaml: &str) {
        let before = self.endpoint_table().await["version"]
            .as_u64()
            .expect("version");
        self.router.rewrite_config(yaml).unwrap();
        eventually(
            "router to reload its config",
            Duration::from_secs(10),
            || async {
                let v = self.endpoint_table().await;
                (v["version"].as_u64() > Some(before)).then_some(())
            },
        )
        .await;
    }

    /// [`Stack::reload`] with [`router_config`] for `replicas` and `extra`.
    pub async fn reconfigure(&self, replicas: &[SocketAddr], extra: &str) {
        self.reload(&router_config(self.dir.path(), replicas, extra))
            .await;
    }

    /// [`Stack::reload`] with [`router_config_with_pool`] for the stack's replicas (their KV
    /// events included).
    pub async fn reconfigure_pool(&self, extra: &str, pool_extra: &str) {
        self.reload(&router_config_with_pool(
            self.dir.path(),
            &self.replicas,
            extra,
            pool_extra,
        ))
        .await;
    }
}

/// The row of candidate `addr` in an explanation.
pub fn candidate_row(explain: &serde_json::Value, addr: SocketAddr) -> &serde_json::Value {
    explain["candidates"]
        .as_array()
        .expect("candidates")
        .iter()
        .find(|c| c["endpoint"] == addr.to_string())
        .unwrap_or_else(|| panic!("no row for {addr}: {explain}"))
}
