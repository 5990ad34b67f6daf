//! The last ten minutes, per model, in five-second buckets, and the latest
//! isolation alarms: what the operator console (`/console/`) shows live
//! through `GET /admin/v1/stats`.
//!
//! Prometheus keeps counters since start and leaves rates to the scraper; an
//! operator looking at one server with no Prometheus in between still wants
//! "tokens per second and time to first token over the last minutes". These
//! series are that, and nothing more: counts and latencies by model id (a
//! validated name, bounded by the catalog), never request text (invariant
//! I9). They live in memory and start empty on every start.
//!
//! Recording is one short mutex hold per request's end as its client heard
//! it, per end in the engine (its tokens, a client's that left too) and per
//! first token; a bucket older than [`WINDOW_BUCKETS`] is dropped as time moves on,
//! so memory is bounded by models x buckets whatever the traffic. Alarms (a
//! blocked canary, an engine panic, a plugin disabled or tripped by its
//! faults) keep the latest [`ALARMS_KEPT`] of each kind, so a tenant whose
//! plugin trips again and again cannot push a blocked canary out of the
//! operator's view; the audit log holds them all.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

/// Alarms kept in memory of each kind, newest first.
pub const ALARMS_KEPT: usize = 100;

/// Something an operator must look at. Content-free: names and counts.
#[derive(Clone, Debug, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct Alarm {
    /// When, Unix milliseconds.
    pub at_ms: u64,
    /// `canary` (a response carrying another tenant's canary was blocked),
    /// `engine_fault` (a model's engine panicked), `plugin_disabled` (a
    /// tenant's plugin disabled after repeated faults) or `plugin_tripped`
    /// (an operator plugin tripped for one tenant).
    pub kind: &'static str,
    /// The model or tenant it concerns.
    pub subject: String,
    /// What else there is to say: the other tenant, the plugin, counts.
    pub detail: String,
}

/// One bucket's width.
pub const BUCKET_MS: u64 = 5_000;
/// Buckets kept: ten minutes.
pub const WINDOW_BUCKETS: usize = 120;

/// One model's counts in one bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct Point {
    /// The bucket's start, Unix milliseconds (a multiple of the width).
    pub at_ms: u64,
    /// Requests that ended in it (served, cancelled or ended by the engine).
    pub requests: u64,
    /// Prompt tokens of the requests the engine ended in it (those whose
    /// client left before the end too).
    pub prompt_tokens: u64,
    /// Tokens those requests generated (counted when each request ends).
    pub generated_tokens: u64,
    /// First tokens sent in it.
    pub first_tokens: u64,
    /// Their times to first token, summed, milliseconds.
    pub ttft_ms_sum: f64,
    /// The longest of them, milliseconds.
    pub ttft_ms_max: f64,
}

/// Buckets per model, oldest first.
#[derive(Default)]
struct Series {
    models: BTreeMap<String, VecDeque<Point>>,
}

impl Series {
    /// The bucket of `model` that holds `now_ms`, made if missing; buckets
    /// that fell out of the window are dropped on the way.
    fn bucket(&mut self, model: &str, now_ms: u64) -> &mut Point {
        let at_ms = now_ms - now_ms % BUCKET_MS;
        if !self.models.contains_key(model) {
            self.models.insert(model.to_string(), VecDeque::new());
        }
        let points = self.models.get_mut(model).expect("inserted above");
        let oldest = at_ms.saturating_sub(BUCKET_MS * (WINDOW_BUCKETS as u64 - 1));
        while points.front().is_some_and(|p| p.at_ms < oldest) {
            points.pop_front();
        }
        // A clock stepped back lands in the newest bucket, never before it.
        if points.back().is_none_or(|p| p.at_ms < at_ms) {
            points.push_back(Point {
                at_ms,
                ..Point::default()
            });
        }
        points.back_mut().expect("pushed above")
    }

    fn window(&self, model: &str, now_ms: u64) -> Vec<Point> {
        let at_ms = now_ms - now_ms % BUCKET_MS;
        let oldest = at_ms.saturating_sub(BUCKET_MS * (WINDOW_BUCKETS as u64 - 1));
        self.models
            .get(model)
            .map(|points| {
                points
                    .iter()
                    .filter(|p| p.at_ms >= oldest)
                    .copied()
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The recorder: one per process, as the metrics recorder is.
pub struct Recent {
    series: Mutex<Series>,
    alarms: Mutex<Alarms>,
}

/// Per kind, newest first, at most [`ALARMS_KEPT`], each with its number
/// since start; and how many since start.
type Alarms = (BTreeMap<&'static str, VecDeque<(u64, Alarm)>>, u64);

static RECENT: Recent = Recent::new();

/// The process's recorder.
pub fn recent() -> &'static Recent {
    &RECENT
}

impl Recent {
    pub const fn new() -> Recent {
        Recent {
            series: Mutex::new(Series {
                models: BTreeMap::new(),
            }),
            alarms: Mutex::new((BTreeMap::new(), 0)),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut Series) -> T) -> T {
        // Plain counts: a poisoned lock still holds usable numbers.
        f(&mut self.series.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// A request of `model` ended at `now_ms`, as its client heard of it
    /// (or left).
    pub fn finished(&self, model: &str, now_ms: u64) {
        self.with(|s| s.bucket(model, now_ms).requests += 1);
    }

    /// The engine of `model` ended a request at `now_ms` that took `prompt`
    /// tokens and generated `generated`.
    pub fn tokens(&self, model: &str, now_ms: u64, prompt: u32, generated: u32) {
        self.with(|s| {
            let point = s.bucket(model, now_ms);
            point.prompt_tokens += u64::from(prompt);
            point.generated_tokens += u64::from(generated);
        });
    }

    /// A request of `model` sent its first token at `now_ms`, `elapsed`
    /// after it arrived.
    pub fn first_token(&self, model: &str, now_ms: u64, elapsed: Duration) {
        let ms = elapsed.as_secs_f64() * 1e3;
        self.with(|s| {
            let point = s.bucket(model, now_ms);
            point.first_tokens += 1;
            point.ttft_ms_sum += ms;
            point.ttft_ms_max = point.ttft_ms_max.max(ms);
        });
    }

    /// `model`'s buckets within the window ending at `now_ms`, oldest first
    /// (buckets without events are left out).
    pub fn window(&self, model: &str, now_ms: u64) -> Vec<Point> {
        self.with(|s| s.window(model, now_ms))
    }

    /// Raises an alarm (kept in memory; the caller audits it).
    pub fn alarm(&self, kind: &'static str, subject: &str, detail: String) {
        let alarm = Alarm {
            at_ms: crate::clock::now_ms(),
            kind,
            subject: subject.to_string(),
            detail,
        };
        let mut alarms = self.alarms.lock().unwrap_or_else(|p| p.into_inner());
        let number = alarms.1;
        alarms.1 += 1;
        let ring = alarms.0.entry(kind).or_default();
        ring.push_front((number, alarm));
        ring.truncate(ALARMS_KEPT);
    }

    /// The latest alarms of every kind, newest first, and how many were
    /// raised since start.
    pub fn alarms(&self) -> (Vec<Alarm>, u64) {
        let alarms = self.alarms.lock().unwrap_or_else(|p| p.into_inner());
        let mut kept: Vec<&(u64, Alarm)> = alarms.0.values().flatten().collect();
        kept.sort_by_key(|(number, _)| std::cmp::Reverse(*number));
        let kept = kept.into_iter().map(|(_, alarm)| alarm.clone()).collect();
        (kept, alarms.1)
    }

    /// Forgets a model (unloaded): its series ends with it.
    pub fn forget(&self, model: &str) {
        self.with(|s| s.models.remove(model));
    }
}

impl Default for Recent {
    fn default() -> Recent {
        Recent::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_800_000_000_000;

    #[test]
    fn events_land_in_their_five_second_bucket() {
        let recent = Recent::new();
        recent.tokens("m", T0 + 1, 10, 20);
        recent.finished("m", T0 + 2);
        // A client that left: counted when it left, its tokens when the
        // engine ends the request.
        recent.finished("m", T0 + 3);
        recent.tokens("m", T0 + 4_999, 5, 7);
        recent.first_token("m", T0 + 2_000, Duration::from_millis(30));
        recent.first_token("m", T0 + 3_000, Duration::from_millis(90));
        recent.tokens("m", T0 + 5_000, 1, 1);
        recent.tokens("other", T0, 100, 100);
        recent.finished("other", T0);
        let points = recent.window("m", T0 + 6_000);
        assert_eq!(points.len(), 2);
        assert_eq!(points[0].at_ms, T0);
        assert_eq!(points[0].requests, 2);
        assert_eq!(points[0].prompt_tokens, 15);
        assert_eq!(points[0].generated_tokens, 27);
        assert_eq!(points[0].first_tokens, 2);
        assert!((points[0].ttft_ms_sum - 120.0).abs() < 1e-6);
        assert!((points[0].ttft_ms_max - 90.0).abs() < 1e-6);
        assert_eq!(points[1].at_ms, T0 + 5_000);
        assert_eq!((points[1].requests, points[1].generated_tokens), (0, 1));
        assert!(recent.window("nobody", T0).is_empty());
    }

    #[test]
    fn the_window_keeps_ten_minutes_and_memory_stays_bounded() {
        let recent = Recent::new();
        // An event every bucket for half an hour.
        for i in 0..360 {
            recent.finished("m", T0 + i * BUCKET_MS);
        }
        let now = T0 + 359 * BUCKET_MS;
        let points = recent.window("m", now);
        assert_eq!(points.len(), WINDOW_BUCKETS);
        assert_eq!(
            points[0].at_ms,
            now - (WINDOW_BUCKETS as u64 - 1) * BUCKET_MS
        );
        assert_eq!(recent.with(|s| s.models["m"].len()), WINDOW_BUCKETS);
        // Read later with no new events: old buckets fall out of the answer.
        let later = now + 60 * BUCKET_MS;
        assert_eq!(recent.window("m", later).len(), WINDOW_BUCKETS - 60);
        assert!(recent.window("m", later + 600_000).is_empty());
        recent.forget("m");
        assert!(recent.with(|s| s.models.is_empty()));
    }

    #[test]
    fn alarms_keep_the_newest_and_count_them_all() {
        let recent = Recent::new();
        assert_eq!(recent.alarms(), (vec![], 0));
        for i in 0..ALARMS_KEPT + 5 {
            recent.alarm("canary", "alpha", format!("n={i}"));
        }
        let (kept, total) = recent.alarms();
        assert_eq!((kept.len(), total), (ALARMS_KEPT, ALARMS_KEPT as u64 + 5));
        assert_eq!(kept[0].detail, format!("n={}", ALARMS_KEPT + 4));
        assert_eq!(kept[ALARMS_KEPT - 1].detail, "n=5");
    }

    #[test]
    fn a_flood_of_one_kind_of_alarm_hides_no_other() {
        let recent = Recent::new();
        recent.alarm("canary", "alpha", "blocked".into());
        for i in 0..3 * ALARMS_KEPT {
            recent.alarm("plugin_tripped", "mallory", format!("n={i}"));
        }
        let (kept, total) = recent.alarms();
        assert_eq!(total, 3 * ALARMS_KEPT as u64 + 1);
        assert_eq!(kept.len(), ALARMS_KEPT + 1);
        let canaries: Vec<&Alarm> = kept.iter().filter(|a| a.kind == "canary").collect();
        assert_eq!(canaries.len(), 1);
        assert_eq!(canaries[0].subject, "alpha");
        // Newest first across kinds.
        assert!(kept.windows(2).all(|w| w[0].at_ms >= w[1].at_ms));
        assert_eq!(kept[0].detail, format!("n={}", 3 * ALARMS_KEPT - 1));
    }

    #[test]
    fn a_clock_stepped_back_counts_in_the_newest_bucket() {
        let recent = Recent::new();
        recent.tokens("m", T0 + 10_000, 1, 1);
        recent.tokens("m", T0, 1, 2);
        let points = recent.window("m", T0 + 10_000);
        assert_eq!(points.len(), 1);
        assert_eq!(points[0].generated_tokens, 3);
    }
}
