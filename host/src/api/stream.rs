//! A request's events after submission: metrics for every request, and the
//! SSE body of a streamed one.
//!
//! 1. [`Tracker`] watches a request's events: time to first text, gaps between
//!    texts, and, at the finish, the request and token counters. It logs ids,
//!    counts and reasons, never text.
//! 2. [`SseBody`] owns the request's event receiver and turns events into
//!    OpenAI's SSE frames as hyper polls it. Hyper drops the body when the
//!    client goes away; that drops the receiver, and the scheduler cancels
//!    the request and releases its pages within one step.
//!
//! ```text
//!  role chunk ─► text chunk* ─► finish chunk ─► [usage chunk] ─► [DONE]
//!                    └─(timeout | shutdown | error)─► error event ─► end
//! ```

use super::error::ApiError;
use super::guard::OutputGuard;
use super::openai::{logprobs_value, Endpoint, ResponseMeta};
use super::tools::{CallsWriter, Pushed};
use crate::engine::request::{Event, FinishReason, RequestId, TokenLogprob, Usage};
use crate::telemetry;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;

/// Watches one request's events for metrics and its closing log line (its
/// usage and its tokens are counted by the scheduler, which sees every end).
pub struct Tracker {
    request_id: RequestId,
    tenant: String,
    model: String,
    arrived: Instant,
    last_text: Option<Instant>,
    finished: bool,
}

impl Tracker {
    /// Starts watching a request of `tenant` on `model` that arrived at `arrived`.
    pub fn new(request_id: RequestId, tenant: &str, model: &str, arrived: Instant) -> Tracker {
        Tracker {
            request_id,
            tenant: tenant.to_string(),
            model: model.to_string(),
            arrived,
            last_text: None,
            finished: false,
        }
    }

    /// Sees one event.
    pub fn observe(&mut self, event: &Event) {
        let now = Instant::now();
        match event {
            Event::Text(_) => {
                match self.last_text {
                    None => telemetry::observe_first_token(
                        &self.model,
                        &self.tenant,
                        now - self.arrived,
                    ),
                    Some(last) => {
                        telemetry::observe_inter_token(&self.model, &self.tenant, now - last)
                    }
                }
                self.last_text = Some(now);
            }
            Event::Logprob(_) | Event::PromptLogprob(_) => {}
            Event::Finished { reason, usage } => {
                self.finished = true;
                telemetry::count_finished(&self.model, &self.tenant, reason.as_str());
                tracing::info!(
                    request_id = self.request_id.0,
                    tenant = %self.tenant,
                    model = %self.model,
                    reason = reason.as_str(),
                    prompt_tokens = usage.prompt_tokens,
                    completion_tokens = usage.completion_tokens,
                    elapsed_ms = self.arrived.elapsed().as_millis() as u64,
                    "request finished"
                );
            }
        }
    }
}

impl Tracker {
    /// The canary guard ended the response: the engine cancels the request
    /// (counted as the guard's hit, not as a client that left).
    pub fn blocked(&mut self) {
        if !self.finished {
            self.finished = true;
            tracing::warn!(
                request_id = self.request_id.0,
                tenant = %self.tenant,
                model = %self.model,
                "response blocked by the canary guard; request cancelled"
            );
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if !self.finished {
            // The client went away (or the handler was dropped) first: the
            // engine cancels it at its next step. Counted here, where it is
            // seen; the engine counts its tokens when it ends it.
            telemetry::count_cancelled(&self.model, &self.tenant);
            tracing::info!(
                request_id = self.request_id.0,
                tenant = %self.tenant,
                "client disconnected; request cancelled"
            );
        }
    }
}

/// The error a non-successful finish maps to (None: a successful finish).
pub fn finish_error(reason: FinishReason) -> Option<ApiError> {
    match reason {
        FinishReason::Stop | FinishReason::Length => None,
        FinishReason::Timeout => Some(ApiError::Timeout),
        FinishReason::Shutdown => Some(ApiError::Shutdown),
        FinishReason::TenantRemoved => Some(ApiError::TenantRemoved),
        FinishReason::ModelRemoved => Some(ApiError::ModelRemoved),
        FinishReason::EngineFault => Some(ApiError::EngineFault),
        FinishReason::TransferFailed => Some(ApiError::TransferFailed),
        FinishReason::PrefillRefused(refusal) => Some(ApiError::PrefillRefused(refusal)),
        FinishReason::Exported => Some(ApiError::Internal(
            "a prefill job's end reached a client".into(),
        )),
        FinishReason::Cancelled => Some(ApiError::Internal(
            "the engine cancelled a request whose client is still connected".into(),
        )),
        FinishReason::Error => Some(ApiError::Internal(
            "the engine failed the request (see the engine's log line)".into(),
        )),
    }
}

/// A request's log probabilities on their way out. Each token's entry waits
/// here for the next text sent, and goes with it. Under the canary guard
/// they all wait for the end, and go only once their own bytes passed a scan
/// of their own: an entry shows a whole token, and the token that completed
/// a stop sequence holds bytes past the cut that the text never shows.
pub struct LogprobsOut {
    endpoint: Endpoint,
    /// An echoed prompt's first token, until it is sent (with no log
    /// probability: nothing comes before it).
    first: Option<Vec<u8>>,
    pending: Vec<TokenLogprob>,
    /// Characters of token text reported so far (the legacy `text_offset`).
    offset: usize,
    guard: Option<OutputGuard>,
}

impl LogprobsOut {
    /// For a request of `endpoint`; `guard` is its own canary guard, if on.
    pub fn new(endpoint: Endpoint, guard: Option<OutputGuard>) -> LogprobsOut {
        LogprobsOut {
            endpoint,
            first: None,
            pending: Vec::new(),
            offset: 0,
            guard,
        }
    }

    /// For an echoed prompt, whose tokens' entries come first: the first
    /// token's bytes (its entry has no log probability).
    pub fn echoing(mut self, first: Vec<u8>) -> LogprobsOut {
        self.first = Some(first);
        self
    }

    fn push(&mut self, entry: TokenLogprob) {
        self.pending.push(entry);
    }

    fn value(&mut self, entries: &[TokenLogprob]) -> serde_json::Value {
        let first = self.first.take();
        logprobs_value(self.endpoint, first.as_deref(), entries, &mut self.offset)
    }

    /// What may go with text sent now (nothing under the guard).
    fn for_text(&mut self) -> Option<serde_json::Value> {
        if self.guard.is_some() || self.pending.is_empty() && self.first.is_none() {
            return None;
        }
        let entries = std::mem::take(&mut self.pending);
        Some(self.value(&entries))
    }

    /// At a successful end: the rest, once the guard passed it (for a whole
    /// response, even none: `{"content": []}` says there were no tokens).
    fn finish(&mut self, whole: bool) -> Result<Option<serde_json::Value>, ApiError> {
        if let Some(guard) = &mut self.guard {
            let bytes: Vec<u8> = self
                .first
                .iter()
                .chain(self.pending.iter().map(|e| &e.bytes))
                .flat_map(|bytes| bytes.iter().copied())
                .collect();
            guard.text(&String::from_utf8_lossy(&bytes))?;
            guard.finish()?;
        }
        let entries = std::mem::take(&mut self.pending);
        Ok((whole || !entries.is_empty() || self.first.is_some()).then(|| self.value(&entries)))
    }
}

/// Sets a response's or chunk's first choice's `logprobs`.
fn set_logprobs(value: &mut serde_json::Value, logprobs: Option<serde_json::Value>) {
    if let Some(logprobs) = logprobs {
        value["choices"][0]["logprobs"] = logprobs;
    }
}

/// Waits for choice `index`'s whole completion (a dropped future drops the
/// receiver, which cancels its sequence): the choice, with its log
/// probabilities when asked for, and its usage. `echo`: the prompt's text,
/// which the choice's begins with (through the guard, as generated text).
pub async fn collect(
    index: u32,
    mut receiver: UnboundedReceiver<Event>,
    meta: &ResponseMeta,
    mut tracker: Tracker,
    mut guard: Option<OutputGuard>,
    mut logprobs: Option<LogprobsOut>,
    echo: Option<&str>,
) -> Result<(serde_json::Value, Usage), ApiError> {
    let block = |tracker: &mut Tracker, error| {
        tracker.blocked();
        Err(error)
    };
    let mut text = match (echo, &mut guard) {
        (None, _) => String::new(),
        (Some(echo), None) => echo.to_string(),
        (Some(echo), Some(guard)) => match guard.text(echo) {
            Ok(passed) => passed,
            Err(blocked) => return block(&mut tracker, blocked),
        },
    };
    while let Some(event) = receiver.recv().await {
        tracker.observe(&event);
        match event {
            Event::Logprob(entry) | Event::PromptLogprob(entry) => {
                if let Some(out) = &mut logprobs {
                    out.push(entry);
                }
            }
            // A guard's error drops the receiver on return: the engine
            // cancels the request.
            Event::Text(piece) => match &mut guard {
                Some(guard) => match guard.text(&piece) {
                    Ok(passed) => text.push_str(&passed),
                    Err(blocked) => return block(&mut tracker, blocked),
                },
                None => text.push_str(&piece),
            },
            Event::Finished { reason, usage } => {
                if let Some(error) = finish_error(reason) {
                    return Err(error);
                }
                if let Some(guard) = &mut guard {
                    match guard.finish() {
                        Ok(held) => text.push_str(&held),
                        Err(blocked) => return block(&mut tracker, blocked),
                    }
                }
                let logprobs = match logprobs.as_mut().map(|l| l.finish(true)).transpose() {
                    Ok(value) => value.flatten(),
                    Err(blocked) => return block(&mut tracker, blocked),
                };
                let mut choice = meta.choice(index, text, reason);
                if let Some(logprobs) = logprobs {
                    choice["logprobs"] = logprobs;
                }
                return Ok((choice, usage));
            }
        }
    }
    Err(ApiError::Internal(
        "the engine dropped a request without finishing it".into(),
    ))
}

/// The SSE body of a streamed request, or of one of its choices.
pub struct SseBody {
    events: UnboundedReceiver<Event>,
    meta: ResponseMeta,
    include_usage: bool,
    tracker: Tracker,
    /// The canary guard, when the operator turned it on.
    guard: Option<OutputGuard>,
    /// Log probabilities, when the request asked for them.
    logprobs: Option<LogprobsOut>,
    /// Where the output is tool calls: what turns it into their deltas.
    calls: Option<CallsWriter>,
    /// The echoed prompt's text, until it is sent.
    echo: Option<String>,
    frames: VecDeque<Bytes>,
    done: bool,
    /// The choice's index.
    index: u32,
    /// One of several choices ([`ChoicesSse`]): its successful end leaves its
    /// usage here, and the usage chunk and `[DONE]` are the whole stream's.
    usage: Option<Usage>,
    alone: bool,
}

fn sse(value: &serde_json::Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

impl SseBody {
    /// A stream over `events`; the first (role) chunk is ready at once.
    pub fn new(
        events: UnboundedReceiver<Event>,
        meta: ResponseMeta,
        include_usage: bool,
        tracker: Tracker,
        guard: Option<OutputGuard>,
        logprobs: Option<LogprobsOut>,
    ) -> SseBody {
        SseBody::choice(0, events, meta, include_usage, tracker, guard, logprobs)
    }

    /// The stream of choice `index` alone, for a [`ChoicesSse`] (its chunks
    /// say its index; its end sends no usage chunk and no `[DONE]`).
    #[allow(clippy::too_many_arguments)]
    pub fn one_of(
        index: u32,
        events: UnboundedReceiver<Event>,
        meta: ResponseMeta,
        include_usage: bool,
        tracker: Tracker,
        guard: Option<OutputGuard>,
        logprobs: Option<LogprobsOut>,
    ) -> SseBody {
        let mut body =
            SseBody::choice(index, events, meta, include_usage, tracker, guard, logprobs);
        body.alone = false;
        body
    }

    fn choice(
        index: u32,
        events: UnboundedReceiver<Event>,
        meta: ResponseMeta,
        include_usage: bool,
        tracker: Tracker,
        guard: Option<OutputGuard>,
        logprobs: Option<LogprobsOut>,
    ) -> SseBody {
        let mut frames = VecDeque::new();
        if meta.endpoint == super::openai::Endpoint::Chat {
            frames.push_back(sse(&meta.chunk(index, true, None, None, include_usage)));
        }
        SseBody {
            events,
            calls: meta.calls_writer(index),
            meta,
            include_usage,
            tracker,
            guard,
            logprobs,
            echo: None,
            frames,
            done: false,
            index,
            usage: None,
            alone: true,
        }
    }

    /// The prompt's text, which the choice's begins with (`echo`): sent,
    /// through the guard as generated text is, with the prompt's log
    /// probabilities, before the first generated token's.
    pub fn echoing(mut self, echo: Option<String>) -> SseBody {
        self.echo = echo;
        self
    }

    fn on_event(&mut self, event: Event) {
        self.tracker.observe(&event);
        if !matches!(event, Event::PromptLogprob(_)) {
            if let Some(echo) = self.echo.take() {
                self.on_text(echo);
                if self.done {
                    return;
                }
            }
        }
        match event {
            Event::Logprob(entry) | Event::PromptLogprob(entry) => {
                if let Some(out) = &mut self.logprobs {
                    out.push(entry);
                }
            }
            Event::Text(text) => self.on_text(text),
            Event::Finished { reason, usage } => self.on_finished(reason, usage),
        }
    }

    fn on_text(&mut self, text: String) {
        let text = match self.guard.as_mut().map(|g| g.text(&text)) {
            None => text,
            Some(Ok(passed)) => passed,
            Some(Err(blocked)) => return self.block(blocked),
        };
        self.push_text(&text);
    }

    fn push_text(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        let chunks = match self.calls.as_mut().map(|calls| calls.push(text)) {
            Some(pushed) => self.calls_chunks(pushed),
            None => vec![self
                .meta
                .chunk(self.index, false, Some(text), None, self.include_usage)],
        };
        self.push_chunks(chunks);
    }

    /// The chunks of what the calls' reader gave out: its text (not where
    /// it is only the spacing between or after calls), then its entries.
    fn calls_chunks(&self, pushed: Pushed) -> Vec<serde_json::Value> {
        let called = self.calls.as_ref().is_some_and(CallsWriter::called);
        let mut chunks = Vec::new();
        let content = pushed.content;
        if !(content.is_empty() || called && content.trim().is_empty()) {
            chunks.push(self.meta.chunk(
                self.index,
                false,
                Some(&content),
                None,
                self.include_usage,
            ));
        }
        if !pushed.entries.is_empty() {
            chunks.push(
                self.meta
                    .calls_chunk(self.index, pushed.entries, self.include_usage),
            );
        }
        chunks
    }

    /// Queues `chunks`, the log probabilities of their text with the last.
    fn push_chunks(&mut self, mut chunks: Vec<serde_json::Value>) {
        let Some(last) = chunks.last_mut() else {
            return;
        };
        set_logprobs(last, self.logprobs.as_mut().and_then(LogprobsOut::for_text));
        for chunk in &chunks {
            self.frames.push_back(sse(chunk));
        }
    }

    /// Ends the stream with the guard's error and cancels the request (the
    /// engine sees its channel closed).
    fn block(&mut self, error: ApiError) {
        self.tracker.blocked();
        self.done = true;
        self.events.close();
        self.push_error(error);
    }

    fn on_finished(&mut self, reason: FinishReason, usage: Usage) {
        self.done = true;
        if let Some(error) = finish_error(reason) {
            self.push_error(error);
            return;
        }
        if let Some(held) = self.guard.as_mut().map(OutputGuard::finish) {
            match held {
                Ok(held) => self.push_text(&held),
                Err(blocked) => return self.block(blocked),
            }
        }
        // What the calls' reader held back: text after all, or calls.
        if let Some(held) = self.calls.as_mut().map(CallsWriter::finish) {
            let chunks = self.calls_chunks(held);
            self.push_chunks(chunks);
        }
        // Entries of text held back to the end, or of no text: with the last chunk.
        let logprobs = match self.logprobs.as_mut().map(|l| l.finish(false)).transpose() {
            Ok(value) => value.flatten(),
            Err(blocked) => return self.block(blocked),
        };
        let mut last = self
            .meta
            .chunk(self.index, false, None, Some(reason), self.include_usage);
        last["choices"][0]["finish_reason"] =
            self.meta.finish_of(reason, self.calls.as_ref()).into();
        set_logprobs(&mut last, logprobs);
        self.frames.push_back(sse(&last));
        if !self.alone {
            self.usage = Some(usage);
            return;
        }
        if self.include_usage {
            self.frames.push_back(sse(&self.meta.usage_chunk(usage)));
        }
        self.frames
            .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    }

    /// An error event ends the stream (no `[DONE]` follows).
    fn push_error(&mut self, error: ApiError) {
        error.record(self.tracker.request_id, Some(&self.tracker.tenant));
        let value = serde_json::json!({ "error": error.object() });
        self.frames.push_back(sse(&value));
    }
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        loop {
            if let Some(frame) = self.frames.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(frame))));
            }
            if self.done {
                return Poll::Ready(None);
            }
            match self.events.poll_recv(cx) {
                Poll::Ready(Some(event)) => self.on_event(event),
                Poll::Ready(None) => {
                    // The engine dropped the sender without a finish.
                    self.done = true;
                    self.push_error(ApiError::Internal(
                        "the engine dropped a request without finishing it".into(),
                    ));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.frames.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// The usage of a request's choices (`n` a prompt, its prompts' in turn), as
/// OpenAI reports it: each prompt once (and what of it the prefix cache
/// held, its first choice's), the tokens of every choice.
pub fn usage_of_choices(usages: &[Usage], n: usize) -> Usage {
    let firsts = || usages.iter().step_by(n.max(1));
    Usage {
        prompt_tokens: firsts().map(|u| u.prompt_tokens).sum(),
        completion_tokens: usages.iter().map(|u| u.completion_tokens).sum(),
        cached_tokens: firsts().map(|u| u.cached_tokens).sum(),
    }
}

/// The SSE body of a request with several choices: each choice's own stream
/// ([`SseBody::one_of`]: its chunks carry its index), interleaved as their
/// events come; once every choice has ended, the usage chunk (when asked
/// for) and `[DONE]`. A choice that ends in an error ends the whole stream
/// after its error event, and cancels the others.
pub struct ChoicesSse {
    choices: Vec<SseBody>,
    /// Choices a prompt (`n`): the usage counts each prompt once.
    n: usize,
    ended: Vec<bool>,
    meta: ResponseMeta,
    include_usage: bool,
    frames: VecDeque<Bytes>,
    done: bool,
    /// The choice polled first next time (each in turn goes first).
    next: usize,
}

impl ChoicesSse {
    /// A stream of `choices` (in index order), `n` of each prompt.
    pub fn new(
        choices: Vec<SseBody>,
        n: usize,
        meta: ResponseMeta,
        include_usage: bool,
    ) -> ChoicesSse {
        ChoicesSse {
            ended: vec![false; choices.len()],
            choices,
            n,
            meta,
            include_usage,
            frames: VecDeque::new(),
            done: false,
            next: 0,
        }
    }

    /// Choice `i`'s stream has ended: with its usage, or after an error.
    fn on_ended(&mut self, i: usize) {
        self.ended[i] = true;
        if self.choices[i].usage.is_none() {
            self.done = true;
            for choice in &mut self.choices {
                choice.events.close();
            }
            return;
        }
        if self.ended.iter().all(|&ended| ended) {
            self.done = true;
            if self.include_usage {
                let usages: Vec<Usage> = self.choices.iter().filter_map(|c| c.usage).collect();
                let usage = usage_of_choices(&usages, self.n);
                self.frames.push_back(sse(&self.meta.usage_chunk(usage)));
            }
            self.frames
                .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        }
    }
}

impl Body for ChoicesSse {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        loop {
            if let Some(frame) = self.frames.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(frame))));
            }
            if self.done {
                return Poll::Ready(None);
            }
            let count = self.choices.len();
            let mut ended = None;
            for k in 0..count {
                let i = (self.next + k) % count;
                if self.ended[i] {
                    continue;
                }
                match Pin::new(&mut self.choices[i]).poll_frame(cx) {
                    Poll::Ready(Some(frame)) => {
                        self.next = (i + 1) % count;
                        return Poll::Ready(Some(frame));
                    }
                    Poll::Ready(None) => {
                        ended = Some(i);
                        break;
                    }
                    Poll::Pending => {}
                }
            }
            match ended {
                Some(i) => self.on_ended(i),
                None => return Poll::Pending,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.frames.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::tools::CallsOut;
    use http_body_util::BodyExt;

    #[test]
    fn usage_counts_each_prompt_once_and_every_choices_tokens() {
        let u = |prompt_tokens, completion_tokens, cached_tokens| Usage {
            prompt_tokens,
            completion_tokens,
            cached_tokens,
        };
        // Two prompts (5 and 7 tokens), two choices each: the later choice
        // of each found its prompt's pages in the prefix cache.
        let usages = [u(5, 3, 0), u(5, 4, 4), u(7, 2, 0), u(7, 1, 4)];
        let total = usage_of_choices(&usages, 2);
        assert_eq!(
            (
                total.prompt_tokens,
                total.completion_tokens,
                total.cached_tokens
            ),
            (12, 10, 0)
        );
        // Four prompts, one choice each: every prompt counts.
        let total = usage_of_choices(&usages, 1);
        assert_eq!((total.prompt_tokens, total.cached_tokens), (24, 8));
        // One prompt, four choices.
        let total = usage_of_choices(&[u(5, 3, 1), u(5, 4, 4)], 2);
        assert_eq!((total.prompt_tokens, total.cached_tokens), (5, 1));
    }

    /// The data of each event of a stream of `texts` then a finish, for a
    /// chat whose calls are read as `calls`.
    fn streamed(calls: CallsOut, texts: &[&str], reason: FinishReason) -> Vec<serde_json::Value> {
        let (events, receiver) = tokio::sync::mpsc::unbounded_channel();
        for text in texts {
            events.send(Event::Text(text.to_string())).unwrap();
        }
        let usage = Usage::default();
        events.send(Event::Finished { reason, usage }).unwrap();
        let meta = ResponseMeta {
            id: "chatcmpl-9".into(),
            created: 1,
            model: "m".into(),
            endpoint: Endpoint::Chat,
            calls: Some(calls),
        };
        let tracker = Tracker::new(RequestId(9), "alpha", "m", Instant::now());
        let body = SseBody::new(receiver, meta, false, tracker, None, None);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let bytes = runtime.block_on(body.collect()).unwrap().to_bytes();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        let data: Vec<&str> = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .collect();
        assert_eq!(data.last(), Some(&"[DONE]"));
        data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    fn content(chunks: &[serde_json::Value]) -> String {
        chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect()
    }

    /// Every `tool_calls` entry of a stream's chunks.
    fn calls(chunks: &[serde_json::Value]) -> Vec<&serde_json::Value> {
        chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
            .flatten()
            .collect()
    }

    fn finish(chunks: &[serde_json::Value]) -> &str {
        chunks.last().unwrap()["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
    }

    #[test]
    fn a_tagged_stream_gives_out_text_and_each_call_once_its_block_closes() {
        let tools = CallsOut::Tagged(vec!["now".into()]);
        let chunks = streamed(
            tools.clone(),
            &[
                "Sure.",
                " <tool",
                "_call>\n{\"name\": \"now\", \"argu",
                "ments\": {\"zone\": \"CET\"}}\n</tool_call>",
                "\n",
            ],
            FinishReason::Stop,
        );
        assert_eq!(content(&chunks), "Sure. ");
        let calls = calls(&chunks);
        assert_eq!(calls.len(), 1, "{chunks:?}");
        assert_eq!(calls[0]["id"], "call_9_0_0");
        assert_eq!(calls[0]["function"]["name"], "now");
        assert_eq!(calls[0]["function"]["arguments"], r#"{"zone":"CET"}"#);
        assert_eq!(finish(&chunks), "tool_calls");
        // No call: every byte is text (what looked like a block's beginning
        // included), and the finish is stop.
        let chunks = streamed(tools, &["1 <", "tool_ca"], FinishReason::Stop);
        assert_eq!(content(&chunks), "1 <tool_ca");
        assert_eq!(finish(&chunks), "stop");
    }

    #[test]
    fn a_named_or_required_stream_has_no_content_from_its_first_chunk_on() {
        for tools in [CallsOut::Named("now".into()), CallsOut::Listed] {
            let texts: &[&str] = match tools {
                CallsOut::Named(_) => &["{\"zone\":", " \"CET\"}"],
                _ => &["[{\"name\": \"now\", ", "\"arguments\": {}}]"],
            };
            let chunks = streamed(tools.clone(), texts, FinishReason::Stop);
            let first = &chunks[0]["choices"][0]["delta"];
            assert_eq!(first["role"], "assistant", "{tools:?}");
            assert!(first["content"].is_null(), "{tools:?}: {first}");
            assert_eq!(content(&chunks), "", "{tools:?}");
            assert_eq!(calls(&chunks)[0]["function"]["name"], "now", "{tools:?}");
            assert_eq!(finish(&chunks), "tool_calls", "{tools:?}");
        }
        // Text answers start with empty content, as OpenAI's do.
        let chunks = streamed(
            CallsOut::Tagged(vec!["now".into()]),
            &["Hi"],
            FinishReason::Stop,
        );
        assert_eq!(chunks[0]["choices"][0]["delta"]["content"], "");
    }

    #[test]
    fn a_bare_stream_gives_out_its_calls_at_the_end_or_its_text_as_it_comes() {
        let tools = CallsOut::Bare(vec!["now".into()]);
        let chunks = streamed(
            tools.clone(),
            &["{\"name\": \"now\",", " \"parameters\": {}}"],
            FinishReason::Stop,
        );
        assert_eq!(content(&chunks), "");
        let calls = calls(&chunks);
        assert_eq!(calls.len(), 1, "{chunks:?}");
        assert_eq!(calls[0]["function"]["name"], "now");
        assert_eq!(finish(&chunks), "tool_calls");
        let chunks = streamed(tools, &["It is ", "noon."], FinishReason::Stop);
        assert_eq!(content(&chunks), "It is noon.");
        assert_eq!(finish(&chunks), "stop");
    }

    #[test]
    fn a_whole_tagged_answer_is_its_text_and_its_calls() {
        let meta = ResponseMeta {
            id: "chatcmpl-4".into(),
            created: 1,
            model: "m".into(),
            endpoint: Endpoint::Chat,
            calls: Some(CallsOut::Tagged(vec!["now".into()])),
        };
        let called = meta.choice(
            0,
            "Checking.\n<tool_call>\n{\"name\": \"now\"}\n</tool_call>".into(),
            FinishReason::Stop,
        );
        assert_eq!(called["message"]["content"], "Checking.");
        assert_eq!(
            called["message"]["tool_calls"][0]["function"]["name"],
            "now"
        );
        assert_eq!(
            called["message"]["tool_calls"][0]["function"]["arguments"],
            "{}"
        );
        assert_eq!(called["finish_reason"], "tool_calls");
        let only = meta.choice(
            0,
            "<tool_call>{\"name\": \"now\"}</tool_call>".into(),
            FinishReason::Stop,
        );
        assert!(only["message"]["content"].is_null(), "{only}");
        let text = meta.choice(0, " Just text. ".into(), FinishReason::Length);
        assert_eq!(text["message"]["content"], " Just text. ");
        assert!(text["message"].get("tool_calls").is_none(), "{text}");
        assert_eq!(text["finish_reason"], "length");
    }

    fn entry(bytes: &[u8], logprob: f32) -> TokenLogprob {
        TokenLogprob {
            bytes: bytes.to_vec(),
            logprob,
            top: vec![(bytes.to_vec(), logprob)],
        }
    }

    /// An echoing completion's events: two prompt tokens' entries after the
    /// first, one generated token's, its text, the end.
    fn echoed_events() -> UnboundedReceiver<Event> {
        let (events, receiver) = tokio::sync::mpsc::unbounded_channel();
        for event in [
            Event::PromptLogprob(entry(b" big", -3.0)),
            Event::PromptLogprob(entry(b" cat", -2.0)),
            Event::Logprob(entry(b" sat", -1.0)),
            Event::Text(" sat".into()),
            Event::Finished {
                reason: FinishReason::Length,
                usage: Usage::default(),
            },
        ] {
            events.send(event).unwrap();
        }
        receiver
    }

    fn completion_meta() -> ResponseMeta {
        ResponseMeta {
            id: "cmpl-5".into(),
            created: 1,
            model: "m".into(),
            endpoint: Endpoint::Completions,
            calls: None,
        }
    }

    #[test]
    fn an_echoed_prompt_comes_first_with_its_log_probabilities_streamed_or_whole() {
        let tracker = || Tracker::new(RequestId(5), "alpha", "m", Instant::now());
        let logprobs =
            || Some(LogprobsOut::new(Endpoint::Completions, None).echoing(b"A".to_vec()));
        let body = SseBody::new(
            echoed_events(),
            completion_meta(),
            false,
            tracker(),
            None,
            logprobs(),
        )
        .echoing(Some("A big cat".into()));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let bytes = runtime.block_on(body.collect()).unwrap().to_bytes();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        let chunks: Vec<serde_json::Value> = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let texts: Vec<&str> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["text"].as_str())
            .filter(|t| !t.is_empty())
            .collect();
        assert_eq!(texts, ["A big cat", " sat"], "{chunks:?}");
        let first = &chunks[0]["choices"][0]["logprobs"];
        assert_eq!(first["tokens"], serde_json::json!(["A", " big", " cat"]));
        assert_eq!(
            first["token_logprobs"],
            serde_json::json!([null, -3.0, -2.0])
        );
        assert_eq!(first["text_offset"], serde_json::json!([0, 1, 5]));
        let second = &chunks[1]["choices"][0]["logprobs"];
        assert_eq!(second["tokens"], serde_json::json!([" sat"]));
        assert_eq!(second["text_offset"], serde_json::json!([9]));

        let (choice, _) = runtime
            .block_on(collect(
                0,
                echoed_events(),
                &completion_meta(),
                tracker(),
                None,
                logprobs(),
                Some("A big cat"),
            ))
            .unwrap();
        assert_eq!(choice["text"], "A big cat sat");
        let whole = &choice["logprobs"];
        assert_eq!(
            whole["tokens"],
            serde_json::json!(["A", " big", " cat", " sat"])
        );
        assert_eq!(
            whole["token_logprobs"],
            serde_json::json!([null, -3.0, -2.0, -1.0])
        );
        assert_eq!(whole["top_logprobs"][0], serde_json::Value::Null);
        assert_eq!(whole["top_logprobs"][3], serde_json::json!({" sat": -1.0}));
    }
}
