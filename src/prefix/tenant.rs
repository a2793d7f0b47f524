//! Tenant salts: which namespace a tenant's prompts hash in, and the `cache_salt` the engine
//! is told.
//!
//! A tenant's salt is its id, or its share group's name when the config groups it with others,
//! so grouped tenants share blocks and every other pair never does.
//!
//! The salt also reaches the engine: vLLM mixes a request's `cache_salt` into its first block's
//! hash, so requests with different salts never share KV blocks inside the engine, even on one
//! replica. What is written there is an HMAC-SHA256 of the salt under a secret key, never the
//! tenant id in clear: the engine, its logs and its KV events see an opaque 128-bit value that
//! nobody without the key can link to a tenant or forge for another tenant. A salt the client
//! sent itself is mixed into the hash rather than dropped, so a client's own isolation (vLLM's
//! meaning of the field) still holds inside its tenant and cannot reach across tenants.

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use ring::hmac;

use crate::config::TenancyConfig;

/// Shortest accepted `cache_salt_key_file` content, in bytes.
const MIN_KEY_BYTES: usize = 16;

/// Why the tenancy settings could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum TenancyError {
    /// The key file could not be read.
    #[error("tenancy.cache_salt_key_file: cannot read {path}: {source}")]
    KeyFile {
        /// The file, as resolved.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The key file holds too few bytes.
    #[error("tenancy.cache_salt_key_file: {path} holds {len} bytes; at least {MIN_KEY_BYTES} are needed")]
    ShortKey {
        /// The file, as resolved.
        path: String,
        /// Its length after trimming the trailing newline.
        len: usize,
    },
}

/// Maps tenant ids to namespace salts and engine `cache_salt`s, built from [`TenancyConfig`].
#[derive(Clone, Default)]
pub struct TenantSalts {
    header: Option<String>,
    group_of: HashMap<String, String>,
    /// `None`: salts are not written into requests (`inject_cache_salt: false`).
    key: Option<hmac::Key>,
}

impl std::fmt::Debug for TenantSalts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key stays out of debug output.
        f.debug_struct("TenantSalts")
            .field("header", &self.header)
            .field("groups", &self.group_of.len())
            .field("inject_cache_salt", &self.key.is_some())
            .finish()
    }
}

/// The per-process key used when the config names no key file: one per process, so a config
/// reload keeps every tenant's salt (and the engine's cache of it).
fn process_key() -> &'static [u8; 32] {
    static KEY: OnceLock<[u8; 32]> = OnceLock::new();
    KEY.get_or_init(rand::random)
}

impl TenantSalts {
    /// Salts per `config`; a relative `cache_salt_key_file` resolves against `base_dir`.
    pub fn from_config(
        config: &TenancyConfig,
        base_dir: &Path,
    ) -> Result<TenantSalts, TenancyError> {
        let mut group_of = HashMap::new();
        for group in &config.share_groups {
            for tenant in &group.tenants {
                // validate() rejects a tenant in two groups; first wins if it ever got here.
                group_of
                    .entry(tenant.clone())
                    .or_insert_with(|| group.name.clone());
            }
        }
        let key = if config.header.is_none() || !config.inject_cache_salt {
            None
        } else {
            Some(match &config.cache_salt_key_file {
                Some(file) => {
                    let path = base_dir.join(file);
                    let shown = path.display().to_string();
                    let mut bytes =
                        std::fs::read(&path).map_err(|source| TenancyError::KeyFile {
                            path: shown.clone(),
                            source,
                        })?;
                    while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                        bytes.pop();
                    }
                    if bytes.len() < MIN_KEY_BYTES {
                        return Err(TenancyError::ShortKey {
                            path: shown,
                            len: bytes.len(),
                        });
                    }
                    hmac::Key::new(hmac::HMAC_SHA256, &bytes)
                }
                None => hmac::Key::new(hmac::HMAC_SHA256, process_key()),
            })
        };
        Ok(TenantSalts {
            header: config.header.clone(),
            group_of,
            key,
        })
    }

    /// The trusted request header naming the tenant, if tenants are configured.
    pub fn header(&self) -> Option<&str> {
        self.header.as_deref()
    }

    /// The salt for `tenant` (the header's value); `None` (no tenant, or no tenancy header
    /// configured) is the shared namespace.
    pub fn salt(&self, tenant: Option<&str>) -> Option<String> {
        self.header.as_ref()?;
        let tenant = tenant?;
        Some(match self.group_of.get(tenant) {
            // Prefixes keep a tenant named like a group out of that group's namespace.
            Some(group) => format!("group:{group}"),
            None => format!("tenant:{tenant}"),
        })
    }

    /// The `cache_salt` to write into a request of `tenant` whose client sent `client` (the
    /// body's own `cache_salt`, if any): `kvr1-` and 32 hex digits of
    /// HMAC-SHA256(key, tenant salt, client salt). `None` when the request has no tenant or
    /// salts are not injected; the body is then forwarded as the client sent it.
    pub fn cache_salt(&self, tenant: Option<&str>, client: Option<&str>) -> Option<String> {
        let key = self.key.as_ref()?;
        let salt = self.salt(tenant)?;
        let mut ctx = hmac::Context::with_key(key);
        // Length-prefixed with a presence tag: no two (salt, client) pairs feed the same bytes.
        ctx.update(&(salt.len() as u64).to_le_bytes());
        ctx.update(salt.as_bytes());
        match client {
            None => ctx.update(&[0]),
            Some(c) => {
                ctx.update(&[1]);
                ctx.update(c.as_bytes());
            }
        }
        let tag = ctx.sign();
        let mut out = String::with_capacity(5 + 32);
        out.push_str("kvr1-");
        for b in &tag.as_ref()[..16] {
            use std::fmt::Write as _;
            let _ = write!(out, "{b:02x}");
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ShareGroupConfig;

    fn grouped() -> TenancyConfig {
        TenancyConfig {
            header: Some("x-tenant".into()),
            share_groups: vec![ShareGroupConfig {
                name: "acme".into(),
                tenants: vec!["acme-prod".into(), "acme-dev".into()],
            }],
            ..TenancyConfig::default()
        }
    }

    #[test]
    fn groups_share_and_everyone_else_is_isolated() {
        let salts = TenantSalts::from_config(&grouped(), Path::new(".")).unwrap();
        assert_eq!(salts.header(), Some("x-tenant"));
        let cases: &[(Option<&str>, Option<&str>, bool)] = &[
            (Some("acme-prod"), Some("acme-dev"), true),
            (Some("acme-prod"), Some("other"), false),
            (Some("acme"), Some("acme-prod"), false),
            (Some("a"), Some("b"), false),
            (None, None, true),
            (None, Some("a"), false),
        ];
        for (a, b, same) in cases {
            assert_eq!(salts.salt(*a) == salts.salt(*b), *same, "{a:?} vs {b:?}");
            assert_eq!(
                salts.cache_salt(*a, None) == salts.cache_salt(*b, None),
                *same,
                "cache_salt {a:?} vs {b:?}"
            );
        }
        // Without a header there are no tenants: everyone shares.
        let none = TenantSalts::default();
        assert_eq!(none.salt(Some("a")), None);
        assert_eq!(none.cache_salt(Some("a"), None), None);
    }

    #[test]
    fn cache_salt_is_keyed_opaque_and_keeps_the_clients_own_split() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("k1"), "0123456789abcdef-one\n").unwrap();
        std::fs::write(dir.path().join("k2"), "0123456789abcdef-two").unwrap();
        let with_key = |file: &str| {
            let config = TenancyConfig {
                cache_salt_key_file: Some(file.into()),
                ..grouped()
            };
            TenantSalts::from_config(&config, dir.path()).unwrap()
        };
        let (a, b) = (with_key("k1"), with_key("k2"));
        let salt = a.cache_salt(Some("globex"), None).unwrap();
        assert!(salt.starts_with("kvr1-") && salt.len() == 37, "{salt}");
        assert!(!salt.contains("globex"), "the tenant id never appears");
        // Stable for one key (routers sharing a key agree), different under another key.
        assert_eq!(
            with_key("k1").cache_salt(Some("globex"), None),
            Some(salt.clone())
        );
        assert_ne!(b.cache_salt(Some("globex"), None), Some(salt.clone()));
        // A client's own salt splits its tenant further but never lands in another tenant.
        let own = a.cache_salt(Some("globex"), Some("user-7")).unwrap();
        assert_ne!(own, salt);
        assert_ne!(a.cache_salt(Some("initech"), Some("user-7")).unwrap(), own);
        assert_ne!(
            a.cache_salt(Some("globex"), Some("")).unwrap(),
            salt,
            "empty != absent"
        );
        // The process key: stable across rebuilds (reloads).
        let p1 = TenantSalts::from_config(&grouped(), dir.path()).unwrap();
        let p2 = TenantSalts::from_config(&grouped(), dir.path()).unwrap();
        assert_eq!(
            p1.cache_salt(Some("t"), None),
            p2.cache_salt(Some("t"), None)
        );
        // Injection off: the namespace salt stays, nothing is written.
        let off = TenantSalts::from_config(
            &TenancyConfig {
                inject_cache_salt: false,
                ..grouped()
            },
            dir.path(),
        )
        .unwrap();
        assert!(off.salt(Some("t")).is_some());
        assert_eq!(off.cache_salt(Some("t"), None), None);
    }

    #[test]
    fn bad_key_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("short"), "tiny\n").unwrap();
        for (file, wanted) in [("short", "holds 4 bytes"), ("missing", "cannot read")] {
            let config = TenancyConfig {
                cache_salt_key_file: Some(file.into()),
                ..grouped()
            };
            let err = TenantSalts::from_config(&config, dir.path())
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("tenancy.cache_salt_key_file: "), "{err}");
            assert!(err.contains(wanted), "{err}");
        }
    }
}
