//! The global `tracing` subscriber: the log lines (as `telemetry::init_logging` sets them up)
//! and, when `tracing.enabled`, the OpenTelemetry layer over an OTLP/gRPC batch exporter.

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider,
};
use opentelemetry_sdk::Resource;
use tracing_subscriber::filter::{EnvFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

use super::span::TARGET;
use crate::config::{LogFormat, TracingConfig};

/// Why the exporter could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum OtelError {
    /// The OTLP exporter rejected its settings.
    #[error("tracing.otlp_endpoint: cannot build the OTLP exporter: {0}")]
    Exporter(String),
}

/// The installed pipeline; [`OtelGuard::shutdown`] exports what is still queued.
#[derive(Debug)]
pub struct OtelGuard {
    provider: SdkTracerProvider,
}

impl OtelGuard {
    /// Exports the spans still queued (waiting at most `timeout`) and stops the exporter.
    pub async fn shutdown(self, timeout: Duration) {
        let provider = self.provider;
        // Blocks until the batch thread has exported; not on an async worker.
        let _ = tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(timeout)).await;
        super::set_enabled(false);
    }
}

/// The log layer's filter: `RUST_LOG` (default `info`), never the decision spans (those are for
/// the OpenTelemetry layer; formatting them would cost every decision).
fn log_filter() -> EnvFilter {
    let base = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    EnvFilter::try_new(format!("{base},{TARGET}=off"))
        .unwrap_or_else(|_| EnvFilter::new(format!("info,{TARGET}=off")))
}

/// The sampler `config` asks for.
pub(super) fn sampler(config: &TracingConfig) -> Sampler {
    let ratio = Sampler::TraceIdRatioBased(config.sampling_ratio);
    if config.parent_based {
        Sampler::ParentBased(Box::new(ratio))
    } else {
        ratio
    }
}

/// The tracer provider exporting to `config.otlp_endpoint` (within a tokio runtime: the gRPC
/// channel lives on it).
fn provider(config: &TracingConfig) -> Result<SdkTracerProvider, OtelError> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(config.otlp_endpoint.clone())
        .with_timeout(Duration::from_millis(config.export_timeout_ms))
        .build()
        .map_err(|e| OtelError::Exporter(e.to_string()))?;
    let batch = BatchConfigBuilder::default()
        .with_max_queue_size(config.max_queue_spans)
        .with_scheduled_delay(Duration::from_millis(config.export_interval_ms))
        .build();
    Ok(SdkTracerProvider::builder()
        .with_sampler(sampler(config))
        .with_resource(
            Resource::builder()
                .with_service_name(config.service_name.clone())
                .build(),
        )
        .with_span_processor(
            BatchSpanProcessor::builder(exporter)
                .with_batch_config(batch)
                .build(),
        )
        .build())
}

/// The OpenTelemetry layer over `provider`, taking decision spans only and none of the
/// optional attributes (code location, thread, busy/idle times).
pub fn layer<S>(provider: &SdkTracerProvider) -> impl Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("kvrouter"))
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_level(false)
        .with_target(false)
        .with_filter(Targets::new().with_target(TARGET, tracing::Level::TRACE))
}

/// Installs the global subscriber: logs on stderr in `format` (level from `RUST_LOG`, default
/// `info`), plus, when `tracing.enabled`, decision spans exported over OTLP/gRPC. Call within a
/// tokio runtime. A second call leaves the first subscriber in place (and exports nothing).
pub fn init_subscriber(
    format: LogFormat,
    tracing_config: &TracingConfig,
) -> Result<Option<OtelGuard>, OtelError> {
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = match format {
        LogFormat::Json => fmt.json().with_filter(log_filter()).boxed(),
        LogFormat::Text => fmt.with_filter(log_filter()).boxed(),
    };
    if !tracing_config.enabled {
        let _ = tracing_subscriber::registry().with(fmt).try_init();
        return Ok(None);
    }
    let provider = provider(tracing_config)?;
    let installed = tracing_subscriber::registry()
        .with(fmt)
        .with(layer(&provider))
        .try_init()
        .is_ok();
    if installed {
        super::set_enabled(true);
    }
    Ok(Some(OtelGuard { provider }))
}
