//! `kiln.Model`: one `.kiln` file opened, verified and served in-process.
//!
//! What a model holds borrows from the file's memory map (the weights in place, the chat
//! template's source), so the file and what borrows it live together in self-referential
//! cells ([`Opened`], then the front and the embedder over it) rather than being leaked as
//! `kiln-run serve` may do for the life of its process: a notebook that opens and drops models
//! gets its memory back. The engine runs on a thread of its own that shares the [`Opened`]
//! cell; dropping the `Model` stops it, and the map goes with the last holder.

use std::path::PathBuf;
use std::sync::Arc;

use kiln_format::KilnFile;
use kiln_runner::draft::{Draft, DraftOptions};
use kiln_runner::engine::prompt_cache::Reuse;
use kiln_runner::engine::{self, Engine, EngineHandle, EngineOptions};
use kiln_runner::generate::DEFAULT_PREFILL_BATCH;
use kiln_runner::serve::embeddings::{EmbedInput, EmbedJob, EmbedService};
use kiln_runner::serve::grammar::Grammars;
use kiln_runner::threads::{cap_notice, max_threads, physical_cores};
use kiln_runner::{
    open_model_verified, CacheType, ChatTemplate, Compute, Interrupt, Model as Weights,
    RunnerError, SamplerConfig, SlidingCache, Tokenizer,
};
use kiln_server::front::Kind;
use kiln_server::{App, FrontConfig, FrontModel};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use self_cell::self_cell;

use crate::embed::Texts;
use crate::errors::{kiln_error, KilnError};
use crate::request::Request;

/// What a model file gives once loaded: the weights in place, the tokenizer, the chat
/// template (when the file has one) and the JSON-schema grammars (when the tokenizer allows).
pub(crate) struct Parts<'f> {
    pub weights: Weights<'f>,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate<'f>>,
    pub grammars: Option<Grammars>,
}

self_cell!(
    /// A model file and what borrows from its map.
    pub(crate) struct Opened {
        owner: KilnFile,
        #[covariant]
        dependent: Parts,
    }
);

self_cell!(
    /// The server's front over an [`Opened`] model: requests in, the server's JSON out.
    pub(crate) struct Front {
        owner: Arc<Opened>,
        #[not_covariant]
        dependent: App,
    }
);

self_cell!(
    /// The embedder of an embedding model.
    pub(crate) struct Embedding {
        owner: Arc<Opened>,
        #[not_covariant]
        dependent: EmbedService,
    }
);

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.borrow_owner().label())
    }
}

/// Open `path` as `kiln-run` does (checksums and the NaN scan unless `verify` is off) and
/// load it: the weights, the tokenizer, the template rendered in-process under its fuel and
/// output limits, and the grammars.
fn open(path: &std::path::Path, verify: bool) -> Result<Opened, RunnerError> {
    let file = open_model_verified(path, verify)?;
    Opened::try_new(file, |file| {
        let weights = Weights::load(file)?;
        let tokenizer = Tokenizer::from_file(file)?;
        let template = ChatTemplate::from_file(file).ok();
        let grammars = Grammars::new(&tokenizer, weights.config.vocab).ok();
        Ok(Parts {
            weights,
            tokenizer,
            template,
            grammars,
        })
    })
}

/// The engine's settings for one model, from `Model(...)`'s keywords.
#[derive(Debug, Clone)]
struct Settings {
    ctx: usize,
    threads: usize,
    cache_type: CacheType,
    options: EngineOptions,
    draft: Option<(Arc<Opened>, DraftOptions)>,
}

/// A `.kiln` model, opened, verified and ready to generate or embed.
///
/// Generation runs on the model's own engine thread, decoding up to `n_parallel` requests
/// together (from several Python threads at once); every method releases the GIL while Kiln
/// works or waits.
#[pyclass(module = "kiln._kiln", frozen)]
pub struct Model {
    pub(crate) opened: Arc<Opened>,
    pub(crate) front: Option<Arc<Front>>,
    pub(crate) embedding: Option<Embedding>,
    /// Raised when the model is closed or dropped: the engine thread ends.
    stop: Interrupt,
    pub(crate) path: PathBuf,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        self.stop.raise(1);
    }
}

/// `threads=`: at least one, at most the CPUs this process may use (with a Python warning).
fn threads_arg(py: Python<'_>, threads: Option<usize>) -> PyResult<usize> {
    match threads {
        Some(0) => Err(PyValueError::new_err(
            "threads: 0; at least one thread is needed",
        )),
        Some(n) => {
            if let Some(notice) = cap_notice(n) {
                let category = py.get_type::<pyo3::exceptions::PyRuntimeWarning>();
                let message = std::ffi::CString::new(notice.replace("--threads", "threads="))
                    .unwrap_or_default();
                PyErr::warn(py, &category, &message, 1)?;
            }
            Ok(n.min(max_threads()))
        }
        None => Ok(physical_cores()),
    }
}

/// A name from `cache_type=`.
fn cache_type_arg(name: &str) -> PyResult<CacheType> {
    name.parse::<CacheType>()
        .map_err(|e| PyValueError::new_err(format!("cache_type: {e}")))
}

#[pymethods]
impl Model {
    /// Open and verify `path`. `n_ctx`: context length in tokens (default: the model's, at
    /// most 4096 as kiln-run's); `threads`: compute threads (default: physical cores);
    /// `n_batch`: prompt tokens per forward pass; `n_parallel`: requests decoded together;
    /// `draft`: a smaller `.kiln` model with the same vocabulary that guesses tokens for this
    /// one to check; `lookup`: tokens guessed from the prompt itself; `cache_type`: the KV
    /// cache's storage (`f16`, `f32`, `q8_0`); `verify`: the checksums and NaN scan on open.
    #[new]
    #[pyo3(signature = (path, *, n_ctx=None, threads=None, n_batch=DEFAULT_PREFILL_BATCH,
        n_parallel=4, draft=None, lookup=0, cache_type="f16", cache_mb=256, verify=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        n_ctx: Option<usize>,
        threads: Option<usize>,
        n_batch: usize,
        n_parallel: usize,
        draft: Option<PathBuf>,
        lookup: usize,
        cache_type: &str,
        cache_mb: usize,
        verify: bool,
    ) -> PyResult<Model> {
        let threads = threads_arg(py, threads)?;
        let cache_type = cache_type_arg(cache_type)?;
        if n_batch == 0 || n_parallel == 0 || n_parallel > 256 {
            return Err(PyValueError::new_err(
                "n_batch must be at least 1, n_parallel between 1 and 256",
            ));
        }
        let options = EngineOptions {
            parallel: n_parallel,
            prefill_batch: n_batch,
            cache_bytes: cache_mb.saturating_mul(1 << 20),
            reuse: Reuse::Exact,
            lookup,
        };
        py.detach(|| {
            let opened = Arc::new(open(&path, verify)?);
            let draft = draft
                .map(|d| open(&d, verify).map(Arc::new))
                .transpose()?
                .map(|d| (d, draft_options(n_batch)));
            let ctx = n_ctx.unwrap_or_else(|| opened.borrow_dependent().weights.default_ctx());
            let settings = Settings {
                ctx,
                threads,
                cache_type,
                options,
                draft,
            };
            Model::start(path, opened, settings)
        })
        .map_err(kiln_error)
    }

    /// The file this model came from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// Context length in tokens (prompt and output together); 0 for an embedding model.
    #[getter]
    fn n_ctx(&self) -> usize {
        self.front
            .as_ref()
            .map_or(0, |f| f.with_dependent(|_, app| app.model().ctx))
    }

    /// The vocabulary size (token ids are below it).
    #[getter]
    fn n_vocab(&self) -> usize {
        self.opened.borrow_dependent().weights.config.vocab
    }

    /// The model's metadata as the file stores it: family, tokenizer settings, generation
    /// defaults and provenance, as a JSON string (`json.loads` it).
    #[getter]
    fn metadata_json(&self) -> PyResult<String> {
        let meta = self.opened.borrow_owner().metadata();
        serde_json::to_string(meta).map_err(|e| KilnError::new_err(e.to_string()))
    }

    /// Token ids of `text`; with `add_special` the tokenizer's own special tokens (BOS) are
    /// added, as `/tokenize` does.
    #[pyo3(signature = (text, add_special=true))]
    fn tokenize(&self, py: Python<'_>, text: &str, add_special: bool) -> PyResult<Vec<u32>> {
        let tok = &self.opened.borrow_dependent().tokenizer;
        py.detach(|| {
            if add_special {
                tok.encode(text)
            } else {
                tok.encode_rendered(text)
            }
        })
        .map_err(kiln_error)
    }

    /// The text of `tokens`, special tokens left out (as `/detokenize` answers).
    fn detokenize(&self, py: Python<'_>, tokens: Vec<u32>) -> PyResult<String> {
        let vocab = self.n_vocab();
        if let Some((i, id)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= vocab)
        {
            return Err(crate::errors::InvalidRequestError::new_err(format!(
                "tokens[{i}] is {id}, not a token id (0 to {})",
                vocab.saturating_sub(1)
            )));
        }
        let tok = &self.opened.borrow_dependent().tokenizer;
        py.detach(|| tok.decode(&tokens)).map_err(kiln_error)
    }

    /// Start a request: `kind` is "chat" or "completion", `body` the OpenAI request's JSON.
    /// Iterating the result gives the server's JSON answers: one body, or the chunks of a
    /// stream.
    fn _request(&self, py: Python<'_>, kind: &str, body: Vec<u8>) -> PyResult<Request> {
        let kind = match kind {
            "chat" => Kind::Chat,
            "completion" => Kind::Completion,
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown request kind {other}"
                )))
            }
        };
        let front = self.front.clone().ok_or_else(|| {
            crate::errors::InvalidRequestError::new_err(format!(
                "{} is an embedding model: it does not generate; use embed()",
                self.path.display()
            ))
        })?;
        Request::start(py, front, kind, body)
    }

    /// Embed `input` (a text, or a list of texts) with an embedding model: a float32 NumPy
    /// array, `(dim,)` for one text and `(n, dim)` for a list, each vector unit length unless
    /// `normalize` is off. `truncate` cuts texts longer than the model takes, as `kiln-run
    /// embed` and sentence-transformers do (off: they are refused, naming the input);
    /// `prompt_name` picks one of the model's named prompts
    /// (sentence-transformers' `prompt_name`).
    #[pyo3(signature = (input, *, normalize=true, truncate=true, prompt_name=None))]
    fn embed<'py>(
        &self,
        py: Python<'py>,
        input: &Bound<'py, PyAny>,
        normalize: bool,
        truncate: bool,
        prompt_name: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let Some(embedding) = &self.embedding else {
            return Err(crate::errors::InvalidRequestError::new_err(format!(
                "{} generates text and has no pooling; open an embedding model (one converted \
                 from a sentence-transformers or BERT checkpoint) to embed",
                self.path.display()
            )));
        };
        let texts = match input.extract::<String>() {
            Ok(t) => Texts::One(t),
            Err(_) => Texts::Many(
                input
                    .extract::<Vec<String>>()
                    .map_err(|_| PyValueError::new_err("input must be a str or a list of str"))?,
            ),
        };
        let job = EmbedJob {
            input: EmbedInput::Texts(Vec::new()),
            dimensions: None,
            truncate,
            normalize,
            prompt_name,
        };
        crate::embed::embed(py, embedding, texts, job)
    }

    /// The vectors' width (0 for a generative model).
    #[getter]
    fn n_embd(&self) -> usize {
        self.embedding
            .as_ref()
            .map_or(0, |e| e.with_dependent(|_, s| s.dim()))
    }

    /// The engine's counters: slots, active, queued, cached sequences and their bytes.
    fn _health(&self) -> String {
        self.front.as_ref().map_or_else(String::new, |f| {
            f.with_dependent(|_, app| app.health().to_string())
        })
    }

    /// Stop the engine thread now (a `Model` also stops when garbage-collected); requests
    /// still running end with an error.
    fn close(&self) {
        self.stop.raise(1);
    }

    fn __repr__(&self) -> String {
        format!("kiln.Model({:?})", self.path.display().to_string())
    }
}

/// The draft's settings: kiln-run's defaults.
fn draft_options(prefill_batch: usize) -> DraftOptions {
    DraftOptions {
        prefill_batch,
        ..DraftOptions::default()
    }
}

impl Model {
    /// Start the engine (or, for an embedding model, the embedder) over `opened`; an error
    /// here (a context too large for memory, a draft with another vocabulary) is the
    /// constructor's.
    fn start(path: PathBuf, opened: Arc<Opened>, s: Settings) -> Result<Model, RunnerError> {
        let stop = Interrupt::new();
        let parts = opened.borrow_dependent();
        if parts.weights.config.embedding.is_some() {
            let label = opened.borrow_owner().label().to_string();
            let embedding = Embedding::try_new(Arc::clone(&opened), |o| {
                let p = o.borrow_dependent();
                EmbedService::new(&p.weights, &p.tokenizer, &label, s.threads, 64)
            })?;
            return Ok(Model {
                opened,
                front: None,
                embedding: Some(embedding),
                stop,
                path,
            });
        }
        let name = path
            .file_stem()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned());
        let generation = &opened.borrow_owner().metadata().generation;
        let sampling = SamplerConfig::from_generation_config(generation);
        sampling.validate()?;
        // Last, once nothing else can fail: a started engine runs until `stop` is raised.
        let handle = spawn_engine(Arc::clone(&opened), &s, stop.clone())?;
        let cfg = FrontConfig {
            sampling,
            ..FrontConfig::default()
        };
        let front = Front::new(Arc::clone(&opened), |o| {
            let p = o.borrow_dependent();
            let model = FrontModel {
                name,
                tokenizer: &p.tokenizer,
                template: p.template.as_ref(),
                ctx: s.ctx,
                vocab: p.weights.config.vocab,
                grammars: p.grammars.as_ref(),
                created: unix_now(),
                embeddings: None,
            };
            App::new(cfg, model, Some(handle), stop.clone())
        });
        Ok(Model {
            opened,
            front: Some(Arc::new(front)),
            embedding: None,
            stop,
            path,
        })
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Start the engine thread over `opened` and wait until its compute (and draft) is built: an
/// error building them is returned here; afterwards the thread serves jobs until `stop`.
fn spawn_engine(
    opened: Arc<Opened>,
    s: &Settings,
    stop: Interrupt,
) -> Result<EngineHandle, RunnerError> {
    let (handle, jobs) = engine::queue(s.options.parallel, 64);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), RunnerError>>();
    let s = s.clone();
    let state = handle.state().clone();
    std::thread::Builder::new()
        .name("kiln-engine".into())
        .spawn(move || {
            let p = opened.borrow_dependent();
            let built = build_compute(p, &s);
            let (mut compute, mut draft) = match built {
                Ok(b) => b,
                Err(e) => return drop(ready_tx.send(Err(e))),
            };
            let _ = ready_tx.send(Ok(()));
            Engine::new(
                &mut compute,
                draft.as_mut(),
                &p.tokenizer,
                s.options.clone(),
            )
            .with_interrupt(stop)
            .with_state(state)
            .serve(jobs);
        })
        .map_err(|e| RunnerError::io("starting the engine thread", e))?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(RunnerError::io(
            "starting the engine thread",
            std::io::Error::other("the engine thread ended before it was ready"),
        )),
    }
}

/// The model's compute for `s.ctx` positions, and the draft's on the same threads.
fn build_compute<'p>(
    p: &'p Parts<'p>,
    s: &'p Settings,
) -> Result<(Compute<'p>, Option<Draft<'p>>), RunnerError> {
    let compute = Compute::new(
        &p.weights,
        s.ctx,
        s.threads,
        s.cache_type,
        SlidingCache::default(),
    )?;
    let draft = match &s.draft {
        None => None,
        Some((d, opts)) => {
            let dp = d.borrow_dependent();
            let dctx = s.ctx.min(dp.weights.config.max_position_embeddings.max(1));
            let dcompute =
                compute.alongside(&dp.weights, dctx, s.cache_type, SlidingCache::default())?;
            Some(Draft::with_compute(
                dcompute,
                &dp.tokenizer,
                &p.tokenizer,
                p.weights.config.vocab,
                *opts,
            )?)
        }
    };
    Ok((compute, draft))
}
