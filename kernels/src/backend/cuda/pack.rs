//! The step buffer: everything a step's kernels read that changes from one
//! step to the next, packed into one array of words on the host and copied
//! to the device: the parts the step uses ([`Packer::used`]), and zeros
//! over what the step before used past them, so the device never holds
//! an earlier step's words (page ids among them) beside a later one's.
//! Regions sit at fixed offsets sized for the largest step, so a captured
//! graph's launches (whose arguments are the regions' addresses) stay
//! valid for every later step.
//!
//! ```text
//! tokens[T] positions[T] token_seq[T] seq_pages[S] gather[R] draws[R][12] adjusts[A][4] pages[P] items[I][10] merges[M][4] counters[M]
//! ```
//!
//! `pages` holds, per sequence, the page ids the page book checked for the
//! step, as far as the step reaches and no further; `draws` the parameters
//! of each drawn row's draw (zeros elsewhere: its argmax), where its
//! adjustments lie in `adjusts` ([`AdjustPlan`]), the log probabilities
//! it asks for, and a scored prompt row's token; `items` are attention's
//! work units (`AttnItem`), `merges` the folds of split decode attention,
//! `counters` zeros for attention to count each merge's finished splits in.

use super::launch::{AttnItem, ATTENTION_TILE, ITEM_WORDS, NO_SEQ};
use super::{CudaOptions, SPLIT_POSITIONS};
use crate::backend::adjust::ADJUST_WORDS;
use crate::backend::logprobs::TOP_LOGPROBS_MAX;
use crate::backend::{Adjust, Draw, Pick, PromptScores};
use crate::kv::PageId;
use crate::model::Model;
use std::ops::Range;

/// Attention blocks a decode step of few sequences aims for: enough to have
/// every multiprocessor of a large GPU (132 on an H100) hold a few.
const DECODE_BLOCKS: u32 = 512;
/// The most splits a decode token's attention is cut into per KV head when
/// its step is small (a long context past 64 x 256 positions takes more).
const DECODE_SPLITS: u32 = 64;
/// Rooms of an adjustment ([`Adjust`], 4 words) a step buffer holds per
/// sequence of the largest step (16 KiB each). A row takes at most its
/// share of them, the room over the step's sequences (1,024 at the largest
/// step, more at a smaller one), so no sequence's list takes another's
/// room; a row whose list takes more is given in full, and its caller
/// adjusts it. A list whose entries mostly share one adjustment (a
/// repetition penalty over a long prompt's tokens) takes a room for that
/// one and a word an id ([`AdjustPlan`]): some 4,000 ids in a share.
const ADJUSTS_PER_SEQ: u64 = 1024;

/// How a row's adjustments are laid out in the step buffer for the pick
/// kernel (sample.cu's `DrawParams`): the entries of their own adjustment
/// first, a room each; then, where at least [`SHARED_MIN`] entries share
/// the list's most common adjustment, that adjustment once (its id word
/// holding only its ban) and their ids after it, four to a room, ascending
/// as the list is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct AdjustPlan {
    /// The entries with an id a vocabulary can reach ([`Adjust::words`]).
    entries: u32,
    /// The shared adjustment ([`adjustment_key`]), and the entries sharing it.
    shared: Option<(u128, u32)>,
}

/// Counters of [`AdjustPlan::vote`].
const VOTE_SLOTS: usize = 4;
/// Entries of a list [`AdjustPlan::vote`] reads at most.
const VOTE_SAMPLE: usize = 64;

/// The fewest entries that share one room: three ids in a room and the
/// adjustment's are two rooms where their own entries were three.
const SHARED_MIN: u32 = 3;

/// An entry's adjustment as one value, its ban's bit and its repetition's,
/// penalty's and bias's bits; `None` for an id no vocabulary reaches
/// ([`Adjust::words`]: left out).
fn adjustment_key(a: &Adjust) -> Option<u128> {
    (a.id < 1 << 31).then(|| {
        u128::from(a.ban) << 96
            | u128::from(a.repetition.to_bits()) << 64
            | u128::from(a.penalty.to_bits()) << 32
            | u128::from(a.bias.to_bits())
    })
}

/// The words of the entry an adjustment's ids share: its ban in the id's
/// top bit, no id.
fn shared_entry(key: u128) -> [u32; ADJUST_WORDS] {
    [
        ((key >> 96) as u32) << 31,
        (key >> 64) as u32,
        (key >> 32) as u32,
        key as u32,
    ]
}

impl AdjustPlan {
    /// The adjustment most of `list`'s entries likely share: the leading
    /// candidate of Misra and Gries' frequent-items count with
    /// [`VOTE_SLOTS`] counters over [`VOTE_SAMPLE`] entries evenly apart
    /// (an adjustment of more than a fifth of them is among its
    /// candidates, and one of most of them leads). No allocation, a few
    /// comparisons an entry sampled.
    fn vote(list: &[Adjust]) -> Option<u128> {
        let apart = list.len().div_ceil(VOTE_SAMPLE).max(1);
        let sample = list.iter().step_by(apart).filter_map(adjustment_key);
        let (mut slots, mut leads) = ([0u128; VOTE_SLOTS], [0u32; VOTE_SLOTS]);
        'entries: for key in sample {
            for i in 0..VOTE_SLOTS {
                if leads[i] > 0 && slots[i] == key {
                    leads[i] += 1;
                    continue 'entries;
                }
            }
            for i in 0..VOTE_SLOTS {
                if leads[i] == 0 {
                    (slots[i], leads[i]) = (key, 1);
                    continue 'entries;
                }
            }
            leads.iter_mut().for_each(|lead| *lead -= 1);
        }
        // The first of the leading (the earliest counted, on a tie).
        let best = (0..VOTE_SLOTS).rev().max_by_key(|&i| leads[i])?;
        (leads[best] > 0).then_some(slots[best])
    }

    /// Lays out `list` into `out` (a row's share of the step buffer's rooms,
    /// zero) in one pass over it: its entries of their own first, then the
    /// voted adjustment once and the ids sharing it, where at least
    /// [`SHARED_MIN`] do ([`AdjustPlan::vote`]; else every entry its own).
    /// `ids` is scratch. `None`, with `out` zero again, where the list's
    /// ids do not ascend (distinct and in order: the kernel's threads
    /// adjust them at once) or its rooms are more than `out` holds.
    pub(super) fn lay_out(
        list: &[Adjust],
        out: &mut [u32],
        ids: &mut Vec<u32>,
    ) -> Option<AdjustPlan> {
        let shared = AdjustPlan::vote(list);
        match AdjustPlan::lay_out_sharing(list, shared, out, ids) {
            // Too few share it to save a room: every entry its own.
            Some(plan) if shared.is_some() && plan.shared.is_none() => {
                AdjustPlan::lay_out_sharing(list, None, out, ids)
            }
            laid => laid,
        }
    }

    /// [`AdjustPlan::lay_out`] with `shared` as the shared adjustment; a
    /// plan with none where fewer than [`SHARED_MIN`] entries have it (and
    /// `out` zero).
    fn lay_out_sharing(
        list: &[Adjust],
        shared: Option<u128>,
        out: &mut [u32],
        ids: &mut Vec<u32>,
    ) -> Option<AdjustPlan> {
        ids.clear();
        let (mut own, mut entries, mut last) = (0usize, 0u32, None::<u32>);
        // Zeroes what was written, and refuses the list.
        let refuse = |out: &mut [u32], own: usize| {
            out[..own].fill(0);
            None
        };
        for a in list {
            if last.is_some_and(|last| last >= a.id) {
                return refuse(out, own);
            }
            last = Some(a.id);
            let Some(key) = adjustment_key(a) else {
                continue;
            };
            entries += 1;
            if Some(key) == shared {
                ids.push(a.id);
                continue;
            }
            if own + ADJUST_WORDS > out.len() {
                return refuse(out, own);
            }
            let words = a.words().expect("an id below 2^31");
            out[own..own + ADJUST_WORDS].copy_from_slice(&words);
            own += ADJUST_WORDS;
        }
        let sharing = ids.len() as u32;
        let Some(key) = shared.filter(|_| sharing >= SHARED_MIN) else {
            if sharing > 0 {
                // Too few share it, and they are not laid out: the caller
                // lays the list out again, each entry its own.
                out[..own].fill(0);
            }
            return Some(AdjustPlan {
                entries,
                shared: None,
            });
        };
        let plan = AdjustPlan {
            entries,
            shared: Some((key, sharing)),
        };
        let words = ADJUST_WORDS * plan.rooms() as usize;
        if words > out.len() {
            return refuse(out, own);
        }
        out[own..own + ADJUST_WORDS].copy_from_slice(&shared_entry(key));
        out[own + ADJUST_WORDS..own + ADJUST_WORDS + ids.len()].copy_from_slice(ids);
        Some(plan)
    }

    /// Entries with their own adjustment, and ids sharing one.
    pub(super) fn counts(&self) -> (u32, u32) {
        let sharing = self.shared.map_or(0, |(_, n)| n);
        (self.entries - sharing, sharing)
    }

    /// The rooms it takes.
    pub(super) fn rooms(&self) -> u64 {
        let (own, sharing) = self.counts();
        let shared_rooms = match sharing {
            0 => 0,
            n => 1 + n.div_ceil(ADJUST_WORDS as u32),
        };
        u64::from(own + shared_rooms)
    }
}

#[cfg(test)]
impl AdjustPlan {
    /// `list` laid out with room for every entry (its ids ascending): the
    /// plan, and its rooms' words.
    pub(super) fn laid_out(list: &[Adjust]) -> (AdjustPlan, Vec<u32>) {
        let mut out = vec![0u32; ADJUST_WORDS * list.len()];
        let plan = AdjustPlan::lay_out(list, &mut out, &mut Vec::new()).expect("ascending ids");
        out.truncate(ADJUST_WORDS * plan.rooms() as usize);
        (plan, out)
    }

    /// The plan of [`AdjustPlan::laid_out`].
    pub(super) fn of(list: &[Adjust]) -> AdjustPlan {
        AdjustPlan::laid_out(list).0
    }
}

/// The splits a decode token of a step of `seqs` sequences aims for, per KV
/// head: [`DECODE_BLOCKS`] over the step's tokens and heads, 1 to
/// [`DECODE_SPLITS`].
fn decode_splits(seqs: u32, kv_heads: u32) -> u32 {
    (DECODE_BLOCKS / (seqs * kv_heads).max(1)).clamp(1, DECODE_SPLITS)
}

/// The positions in each split of a decode token's attention over
/// `positions` positions, in a step of `seqs` sequences: its positions over
/// [`decode_splits`], rounded up to whole tiles, at most [`SPLIT_POSITIONS`].
///
/// One block reads a split's tiles one after another, so a token alone in
/// its step (batch 1) would otherwise read its whole context through a
/// handful of blocks: at depth 512 and three KV heads, six blocks of eight
/// tiles each (and three of one position), the rest of the GPU idle. Finer splits cost a merge of more
/// partials; at a large batch the step's own tokens fill the GPU, and spans
/// stay at [`SPLIT_POSITIONS`].
pub(super) fn decode_span(positions: u32, seqs: u32, kv_heads: u32) -> u32 {
    let splits = decode_splits(seqs, kv_heads);
    positions
        .div_ceil(splits)
        .max(1)
        .next_multiple_of(ATTENTION_TILE)
        .min(SPLIT_POSITIONS)
}

/// The most splits a decode token of a step of `seqs` sequences takes per KV
/// head, at any depth within `context_len`: a span of [`decode_span`] is
/// either at least positions / [`decode_splits`] or [`SPLIT_POSITIONS`].
pub(super) fn decode_splits_max(seqs: u32, kv_heads: u32, context_len: u32) -> u32 {
    decode_splits(seqs, kv_heads).max(context_len.div_ceil(SPLIT_POSITIONS))
}

/// Where each region of the packed step buffer starts, in words, for the
/// largest step: the same addresses for every step, so captured graphs stay valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct StepLayout {
    pub(super) tokens: u64,
    pub(super) positions: u64,
    pub(super) token_seq: u64,
    pub(super) seq_pages: u64,
    pub(super) gather: u64,
    pub(super) draws: u64,
    pub(super) adjusts: u64,
    pub(super) pages: u64,
    pub(super) items: u64,
    pub(super) merges: u64,
    pub(super) counters: u64,
    pub(super) words: u64,
    /// Capacities.
    pub(super) gather_max: u64,
    pub(super) adjusts_max: u64,
    pub(super) pages_max: u64,
    pub(super) items_max: u64,
    pub(super) merges_max: u64,
    pub(super) slots_max: u64,
    /// The pool geometry the page capacity was sized for.
    pub(super) page_tokens: u32,
}

impl StepLayout {
    pub(super) fn new(
        options: &CudaOptions,
        model: &Model,
        page_tokens: u32,
        queries_per_item: u32,
    ) -> StepLayout {
        let c = &model.config;
        let (t, s) = (options.step_tokens_max as u64, options.step_seqs_max as u64);
        let kv_heads = c.kv_heads_count as u64;
        // Decode tokens in up to `decode_splits_max` items (partial slots)
        // each per KV head, for a step of any number of sequences up to `s`.
        let slots_max = (1..=s as u32)
            .map(|seqs| {
                let splits = decode_splits_max(seqs, kv_heads as u32, c.context_len as u32);
                u64::from(seqs) * kv_heads * u64::from(splits)
            })
            .max()
            .unwrap_or(0);
        // Each sequence's table as far as its last position: at most the context.
        let pages_max = s * (c.context_len as u64).div_ceil(u64::from(page_tokens));
        // Prefill chunks in items of `queries_per_item` (one partial item per
        // sequence at most), decode tokens in their splits' items.
        let items_max = kv_heads * (t.div_ceil(u64::from(queries_per_item)) + s) + slots_max;
        let merges_max = s * kv_heads;
        let mut at = 0u64;
        let mut region = |words: u64| {
            let start = at;
            at += words.div_ceil(4) * 4; // 16-byte aligned regions
            start
        };
        let tokens = region(t);
        let positions = region(t);
        let token_seq = region(t);
        let seq_pages = region(s);
        let gather_max = options.limits().step_logits_max() as u64;
        let gather = region(gather_max);
        let draws = region(gather_max * DRAW_WORDS as u64);
        let adjusts_max = s * ADJUSTS_PER_SEQ;
        let adjusts = region(adjusts_max * ADJUST_WORDS as u64);
        let pages = region(pages_max);
        let items = region(items_max * ITEM_WORDS as u64);
        let merges = region(merges_max * 4);
        let counters = region(merges_max);
        StepLayout {
            tokens,
            positions,
            token_seq,
            seq_pages,
            gather,
            draws,
            adjusts,
            pages,
            items,
            merges,
            counters,
            words: at,
            gather_max,
            adjusts_max,
            pages_max,
            items_max,
            merges_max,
            slots_max,
            page_tokens,
        }
    }
}

/// Words between two regions' used parts that are copied with them rather
/// than split the step's copy in two: 16 KiB, some microseconds of the
/// bus, about what one more copy costs to start.
const COPY_GAP_WORDS: usize = 4096;

/// Words of a row's draw in the step buffer (sample.cu's `DrawParams`):
/// 1 / temperature, top-k, top-p and min-p, the uniform as an f64, the
/// first room of the row's adjustments and the count of its own entries,
/// then its log probabilities' ask (0 none, else 1 + the alternatives)
/// and, for a prompt row scored for a given token rather than picked, 1 +
/// that token; the count of ids sharing an adjustment ([`AdjustPlan`]),
/// and a word unused.
pub(super) const DRAW_WORDS: usize = 12;

/// Words of a row's log probabilities as `pick` writes them (sample.cu's
/// `SCORE_WORDS`): the token's, the alternatives' count, then (id, log
/// probability) each.
pub(super) const SCORE_WORDS: usize = 2 + 2 * TOP_LOGPROBS_MAX;

/// A row's pick as `DrawParams` lays it out: its draw (none: its argmax),
/// its adjustments from room `adjust_at` (`adjusts`: its own entries and
/// the ids sharing one, [`AdjustPlan::counts`]), its log probabilities'
/// ask, and the token it scores where it is a prompt's row (none picked
/// then).
pub(super) fn draw_words(
    d: Option<&Draw>,
    adjust_at: u32,
    adjusts: (u32, u32),
    logprobs: Option<u8>,
    target: Option<u32>,
) -> [u32; DRAW_WORDS] {
    let scores = logprobs.map_or(0, |top| 1 + u32::from(top));
    let target = target.map_or(0, |t| t + 1);
    let (own, sharing) = adjusts;
    let (inv_t, top_k, top_p, min_p, u) = match d {
        Some(d) => (
            d.inv_t.to_bits(),
            d.top_k,
            d.top_p.to_bits(),
            d.min_p.to_bits(),
            d.u.to_bits(),
        ),
        None => (0, 0, 0, 0, 0),
    };
    [
        inv_t,
        top_k,
        top_p,
        min_p,
        u as u32,
        (u >> 32) as u32,
        adjust_at,
        own,
        scores,
        target,
        sharing,
        0,
    ]
}

/// A row wanted for its token: its token in the step, how, and its
/// adjustments in the step buffer (first room; own entries and shared
/// ids); or a prompt's row wanted for its score of `target`.
#[derive(Clone, Copy, Debug)]
struct Picked {
    token: u32,
    pick: Pick,
    adjust_at: u32,
    adjusts: (u32, u32),
    logprobs: Option<u8>,
    target: Option<u32>,
}

/// How a sequence's rows of logits leave a step: its first `scored` as
/// their scores alone, its last as its token alone where `picked`, every
/// other row in full.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Given {
    pub(super) scored: u32,
    pub(super) picked: bool,
}

impl Given {
    /// Rows given on the device (as their token or their scores).
    pub(super) fn on_device(&self) -> usize {
        self.scored as usize + usize::from(self.picked)
    }
}

/// `ranges` in order, those that overlap or lie less than
/// [`COPY_GAP_WORDS`] apart joined into one.
pub(super) fn joined(ranges: impl IntoIterator<Item = Range<usize>>) -> Vec<Range<usize>> {
    let mut ranges: Vec<Range<usize>> = ranges.into_iter().collect();
    ranges.sort_unstable_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end + COPY_GAP_WORDS => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// What one step launches over: the sizes of its grids (for a graph, its bucket's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Counts {
    pub(super) tokens: u32,
    pub(super) items: u32,
    pub(super) merges: u32,
    pub(super) wanted: u32,
    /// The most query tokens of one attention item: an attention block's
    /// shared memory is sized for them (a decode-only step's blocks, one
    /// query each, take a fraction of a prefill chunk's, and more fit a
    /// multiprocessor at once).
    pub(super) item_queries_max: u32,
}

/// Writes a step into the words of a [`StepLayout`], counting as it goes.
pub(super) struct Packer<'a> {
    words: &'a mut [u32],
    layout: StepLayout,
    pub(super) counts: Counts,
    /// Page ids packed so far.
    pages: u32,
    /// Partial slots handed out so far.
    slots: u32,
    /// Sequences the step's decode splits are sized for (its own, or its
    /// graph bucket's: a graph's grid is sized for the bucket's splits).
    split_seqs: u32,
    /// Rows wanted for their token alone, gathered after every full row
    /// ([`Packer::picked_rows`]).
    picked: Vec<Picked>,
    /// Adjustments' rooms packed so far.
    adjusts: u32,
    /// The most rooms one row's adjustments may take: the room over `split_seqs`.
    adjust_share: u64,
    /// Scratch of [`AdjustPlan::lay_out`].
    shared_ids: Vec<u32>,
}

impl<'a> Packer<'a> {
    /// A packer over zeroed `words` of `layout`, for a step whose decode
    /// splits are sized for `split_seqs` sequences.
    pub(super) fn new(words: &'a mut [u32], layout: StepLayout, split_seqs: u32) -> Packer<'a> {
        assert_eq!(words.len() as u64, layout.words, "words of another layout");
        Packer {
            split_seqs,
            words,
            layout,
            counts: Counts {
                tokens: 0,
                items: 0,
                merges: 0,
                wanted: 0,
                item_queries_max: 0,
            },
            pages: 0,
            slots: 0,
            picked: Vec::new(),
            adjusts: 0,
            adjust_share: layout.adjusts_max / u64::from(split_seqs.max(1)),
            shared_ids: Vec::new(),
        }
    }

    fn set(&mut self, region: u64, index: u32, value: u32) {
        self.words[(region + u64::from(index)) as usize] = value;
    }

    /// The next token of the step, of sequence `seq`, at `position`.
    pub(super) fn token(&mut self, token: u32, position: u32, seq: u32) {
        let t = self.counts.tokens;
        self.set(self.layout.tokens, t, token);
        self.set(self.layout.positions, t, position);
        self.set(self.layout.token_seq, t, seq);
        self.counts.tokens += 1;
    }

    /// Sequence `seq`'s page table, as the page book checked it.
    pub(super) fn table(&mut self, seq: u32, pages: &[PageId]) {
        self.set(self.layout.seq_pages, seq, self.pages);
        for page in pages {
            self.set(self.layout.pages, self.pages, page.0);
            self.pages += 1;
        }
        assert!(
            u64::from(self.pages) <= self.layout.pages_max,
            "pages past the layout's"
        );
    }

    /// The last `rows` tokens packed want logits: the first of them that
    /// `scores` names, only their scores of its targets; the last, where
    /// `pick` is not [`Pick::Row`], only its token, adjusted by `adjust`
    /// first. Those rows are gathered after every full row
    /// ([`Packer::picked_rows`]), so the full rows are one prefix of the
    /// logits, the only rows the step copies to the host. Returns how the
    /// rows are given: the scored ones always on the device; the last
    /// picked there (with its log probabilities where `logprobs` asks) but
    /// where its adjustments are more than its share of the step buffer's
    /// room ([`AdjustPlan::rooms`]), or not in ascending order of distinct
    /// ids (the row is then a full one).
    pub(super) fn logits(
        &mut self,
        rows: usize,
        pick: Pick,
        adjust: &[Adjust],
        logprobs: Option<u8>,
        scores: PromptScores<'_>,
    ) -> Given {
        let first = self.counts.tokens - rows as u32;
        let scored = scores.targets.len().min(rows) as u32;
        // Entries of distinct ids in order: the kernel's threads adjust
        // them at once, each its own logit (a list in any other order is
        // the host's to apply, one entry after another).
        // Laid out where the row is picked here, within its share.
        let plan = match pick.is_token() && rows > scored as usize {
            true => {
                let room = self.layout.adjusts_max - u64::from(self.adjusts);
                let at = self.layout.adjusts + ADJUST_WORDS as u64 * u64::from(self.adjusts);
                let words = ADJUST_WORDS as u64 * self.adjust_share.min(room);
                let out = &mut self.words[at as usize..(at + words) as usize];
                AdjustPlan::lay_out(adjust, out, &mut self.shared_ids)
            }
            false => None,
        };
        let picked = plan.is_some();
        for (i, &target) in scores.targets[..scored as usize].iter().enumerate() {
            self.picked.push(Picked {
                token: first + i as u32,
                pick: Pick::Argmax,
                adjust_at: 0,
                adjusts: (0, 0),
                logprobs: Some(scores.top),
                target: Some(target),
            });
        }
        for token in first + scored..self.counts.tokens - u32::from(picked) {
            self.gather(token);
        }
        if let Some(plan) = plan {
            let adjust_at = self.adjusts;
            self.adjusts += plan.rooms() as u32;
            self.picked.push(Picked {
                token: self.counts.tokens - 1,
                pick,
                adjust_at,
                adjusts: plan.counts(),
                logprobs,
                target: None,
            });
        }
        Given { scored, picked }
    }

    /// Gathers the rows wanted for their token, in step order, after every
    /// full row, with each draw's parameters and adjustments at its row.
    pub(super) fn picked_rows(&mut self) {
        for p in std::mem::take(&mut self.picked) {
            let draw = match &p.pick {
                Pick::Draw(draw) => Some(draw),
                _ => None,
            };
            if draw.is_some() || p.adjusts != (0, 0) || p.logprobs.is_some() {
                let at = self.layout.draws + (DRAW_WORDS as u64) * u64::from(self.counts.wanted);
                let at = at as usize;
                let words = draw_words(draw, p.adjust_at, p.adjusts, p.logprobs, p.target);
                self.words[at..at + DRAW_WORDS].copy_from_slice(&words);
            }
            self.gather(p.token);
        }
    }

    fn gather(&mut self, token: u32) {
        self.set(self.layout.gather, self.counts.wanted, token);
        self.counts.wanted += 1;
        assert!(
            u64::from(self.counts.wanted) <= self.layout.gather_max,
            "gather rows past the layout's"
        );
    }

    fn item(&mut self, item: AttnItem) {
        let at = (self.layout.items + (ITEM_WORDS as u64) * u64::from(self.counts.items)) as usize;
        self.words[at..at + ITEM_WORDS].copy_from_slice(&item.words());
        self.counts.items += 1;
        let queries = item.t1 - item.t0;
        self.counts.item_queries_max = self.counts.item_queries_max.max(queries);
        assert!(
            u64::from(self.counts.items) <= self.layout.items_max,
            "items past the layout's"
        );
    }

    /// A decode token (token `t` at `pos`): per KV head one item over its
    /// positions, or, past one split ([`decode_span`]), an item per split
    /// into partial slots and a merge of them.
    pub(super) fn decode_items(&mut self, seq: u32, t: u32, pos: u32, kv_heads: u32) {
        let positions = pos + 1;
        let span = decode_span(positions, self.split_seqs, kv_heads);
        let splits = positions.div_ceil(span);
        for kv_head in 0..kv_heads {
            let item = AttnItem {
                seq,
                kv_head,
                t0: t,
                t1: t + 1,
                pos0: pos,
                p0: 0,
                p1: positions,
                partial: NO_SEQ,
                merge: NO_SEQ,
                unused: 0,
            };
            if splits == 1 {
                self.item(item);
                continue;
            }
            let merge = self.counts.merges;
            let at = (self.layout.merges + 4 * u64::from(merge)) as usize;
            self.words[at..at + 4].copy_from_slice(&[t, kv_head, self.slots, splits]);
            self.counts.merges += 1;
            for split in 0..splits {
                let p0 = split * span;
                let p1 = (p0 + span).min(positions);
                self.item(AttnItem {
                    p0,
                    p1,
                    partial: self.slots,
                    merge,
                    ..item
                });
                self.slots += 1;
            }
            assert!(
                u64::from(self.slots) <= self.layout.slots_max,
                "slots past the layout's"
            );
        }
    }

    /// A prefill chunk (tokens `t0` up to the last packed, from `pos0`): per
    /// KV head, items of `per_item` queries over every position up to theirs.
    pub(super) fn prefill_items(
        &mut self,
        seq: u32,
        t0: u32,
        pos0: u32,
        kv_heads: u32,
        per_item: u32,
    ) {
        let t_end = self.counts.tokens;
        for kv_head in 0..kv_heads {
            for a in (t0..t_end).step_by(per_item as usize) {
                let b = (a + per_item).min(t_end);
                let pos = pos0 + (a - t0);
                self.item(AttnItem {
                    seq,
                    kv_head,
                    t0: a,
                    t1: b,
                    pos0: pos,
                    p0: 0,
                    p1: pos + (b - a),
                    partial: NO_SEQ,
                    merge: NO_SEQ,
                    unused: 0,
                });
            }
        }
    }

    /// The words of the step buffer a step of `counts` (this packer's, or
    /// its graph bucket's) over `seqs` sequences reads: each region as far
    /// as the counts reach, in order, runs less than [`COPY_GAP_WORDS`]
    /// apart joined. Everything the packer wrote lies within them, and
    /// nothing a launch reads lies outside: only these are copied to the
    /// device (a step buffer sized for 128 sequences of 8,192 positions is
    /// some 800 KB, of which a decode step of one copies 26 KB).
    pub(super) fn used(&self, counts: &Counts, seqs: u32) -> Vec<Range<usize>> {
        let l = &self.layout;
        let (t, wanted) = (u64::from(counts.tokens), u64::from(counts.wanted));
        let parts = [
            (l.tokens, t),
            (l.positions, t),
            (l.token_seq, t),
            (l.seq_pages, u64::from(seqs)),
            (l.gather, wanted),
            (l.draws, wanted * DRAW_WORDS as u64),
            (l.adjusts, u64::from(self.adjusts) * ADJUST_WORDS as u64),
            (l.pages, u64::from(self.pages)),
            (l.items, u64::from(counts.items) * ITEM_WORDS as u64),
            (l.merges, u64::from(counts.merges) * 4),
            (l.counters, u64::from(counts.merges)),
        ];
        joined(
            parts
                .into_iter()
                .filter(|&(_, len)| len > 0)
                .map(|(start, len)| start as usize..(start + len) as usize),
        )
    }

    /// The counts of a graph of `bucket` sequences: tokens past the step's
    /// of no sequence (they store nothing), and every grid at its capacity
    /// (items and merges past the step's are zero words: no queries, no slots).
    pub(super) fn pad(&mut self, bucket: u32, kv_heads: u32, context_len: u32) -> Counts {
        debug_assert!(self.picked.is_empty(), "picked rows gathered first");
        for pad in self.counts.tokens..bucket {
            self.set(self.layout.token_seq, pad, NO_SEQ);
        }
        let items = bucket * kv_heads * decode_splits_max(bucket, kv_heads, context_len);
        assert!(
            u64::from(items) <= self.layout.items_max,
            "a bucket past the layout"
        );
        Counts {
            tokens: bucket,
            items,
            merges: bucket * kv_heads,
            wanted: bucket,
            item_queries_max: 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the packer picks the row of `rows` on the device, with no
    /// prompt row scored.
    fn on_device(
        packer: &mut Packer<'_>,
        rows: usize,
        pick: Pick,
        adjust: &[Adjust],
        logprobs: Option<u8>,
    ) -> bool {
        let given = packer.logits(rows, pick, adjust, logprobs, PromptScores::NONE);
        assert_eq!(given.scored, 0);
        given.picked
    }

    /// A step buffer sized for many sequences: pages, items, merges far
    /// apart.
    fn sparse_layout() -> StepLayout {
        let mut at = 0u64;
        let mut region = |words: u64| {
            at += words;
            at - words
        };
        let mut layout = StepLayout {
            tokens: region(512),
            positions: region(512),
            token_seq: region(512),
            seq_pages: region(128),
            gather: region(200),
            draws: region(2000),
            adjusts: region(256),
            pages: region(65_536),
            items: region(128_000),
            merges: region(1_536),
            counters: region(384),
            words: 0,
            gather_max: 200,
            adjusts_max: 64,
            pages_max: 65_536,
            items_max: 12_800,
            merges_max: 384,
            slots_max: 12_000,
            page_tokens: 16,
        };
        layout.words = at;
        layout
    }

    #[test]
    fn a_step_copies_each_regions_used_part_joined_across_short_gaps() {
        let layout = sparse_layout();
        let mut words = vec![0u32; layout.words as usize];
        let mut packer = Packer::new(&mut words, layout, 1);
        // One decode token at position 512 of 3 KV heads: 33 pages, 17
        // splits of 32 a head, 3 merges.
        packer.token(7, 512, 0);
        packer.table(0, &[PageId(5); 33]);
        assert!(on_device(&mut packer, 1, Pick::Argmax, &[], None));
        packer.decode_items(0, 0, 512, 3);
        packer.picked_rows();
        let counts = packer.counts;
        assert_eq!((counts.items, counts.merges, counts.wanted), (51, 3, 1));
        let used = packer.used(&counts, 1);
        let l = layout;
        let (pages, items, merges) = (l.pages as usize, l.items as usize, l.merges as usize);
        assert_eq!(
            used,
            vec![
                // Tokens through the pages: each gap under 4,096 words.
                0..pages + 33,
                items..items + 51 * ITEM_WORDS,
                // The merges and, 1,524 words on, their counters.
                merges..l.counters as usize + 3,
            ]
        );
        let copied: usize = used.iter().map(|r| r.len()).sum();
        assert_eq!(copied, pages + 33 + 510 + 1539);
        // Nothing packed lies outside them.
        for (i, &w) in words.iter().enumerate() {
            assert!(w == 0 || used.iter().any(|r| r.contains(&i)), "word {i}");
        }
    }

    #[test]
    fn a_picked_rows_adjustments_are_packed_at_its_draw_and_a_list_past_its_share_gives_the_row_in_full(
    ) {
        let layout = sparse_layout();
        let mut words = vec![0u32; layout.words as usize];
        let mut packer = Packer::new(&mut words, layout, 4);
        let draw = Draw {
            inv_t: 2.0,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.0,
            u: 0.25,
        };
        let banned = Adjust {
            ban: true,
            ..Adjust::none(9)
        };
        let biased = Adjust {
            bias: 1.5,
            ..Adjust::none(3)
        };
        let past = Adjust::none(1 << 31);
        // Each its own adjustment: a room each.
        let distinct = |n: u32| -> Vec<Adjust> {
            (0..n)
                .map(|id| Adjust {
                    bias: id as f32 + 1.0,
                    ..Adjust::none(id)
                })
                .collect()
        };
        let many = distinct(17);
        // Sequence 0: greedy, adjusted (an id past any vocabulary is left
        // out); 1: drawn, adjusted; 2: a full row; 3: drawn, its 17
        // adjustments past its share of the room (64 over 4 sequences),
        // though 61 are left: a full row.
        let steps: [(Pick, &[Adjust]); 4] = [
            (Pick::Argmax, &[biased, banned, past]),
            (Pick::Draw(draw), &[banned]),
            (Pick::Row, &[]),
            (Pick::Draw(draw), &many),
        ];
        let mut picked = Vec::new();
        for (seq, (pick, adjust)) in steps.into_iter().enumerate() {
            packer.token(seq as u32, 5, seq as u32);
            picked.push(on_device(&mut packer, 1, pick, adjust, None));
        }
        packer.picked_rows();
        assert_eq!(picked, [true, true, false, false]);
        assert_eq!(packer.counts.wanted, 4);
        let used = packer.used(&packer.counts, 4);
        let l = layout;
        let word = |region: u64, i: usize| words[region as usize + i];
        // The full rows first (2, 3), then the picked (0, 1).
        let gather: Vec<u32> = (0..4).map(|i| word(l.gather, i)).collect();
        assert_eq!(gather, [2, 3, 0, 1]);
        // Full rows have no draw words; row 2 (sequence 0) its argmax with
        // two adjustments from 0; row 3 its draw with one from 2.
        assert!((0..2 * DRAW_WORDS).all(|i| word(l.draws, i) == 0));
        let row = |r: usize| -> Vec<u32> {
            (0..DRAW_WORDS)
                .map(|i| word(l.draws, r * DRAW_WORDS + i))
                .collect()
        };
        assert_eq!(row(2), draw_words(None, 0, (2, 0), None, None));
        assert_eq!(row(3), draw_words(Some(&draw), 2, (1, 0), None, None));
        assert_eq!(f32::from_bits(row(3)[0]), 2.0);
        let entries: Vec<u32> = (0..3 * ADJUST_WORDS).map(|i| word(l.adjusts, i)).collect();
        let expected: Vec<u32> = [biased, banned, banned]
            .iter()
            .flat_map(|a| a.words().unwrap())
            .collect();
        assert_eq!(entries, expected);
        // Nothing past the three entries, and all of them copied.
        assert!((3 * ADJUST_WORDS..64 * ADJUST_WORDS).all(|i| word(l.adjusts, i) == 0));
        for (i, &w) in words.iter().enumerate() {
            assert!(w == 0 || used.iter().any(|r| r.contains(&i)), "word {i}");
        }
        // A list out of order, or naming an id twice, is the host's to
        // apply in its order: a full row.
        let mut words = vec![0u32; layout.words as usize];
        let mut packer = Packer::new(&mut words, layout, 4);
        packer.token(0, 5, 0);
        assert!(!on_device(
            &mut packer,
            1,
            Pick::Argmax,
            &[biased, Adjust::none(2)],
            None
        ));
        packer.token(1, 5, 1);
        assert!(!on_device(
            &mut packer,
            1,
            Pick::Draw(draw),
            &[banned, banned],
            None
        ));
        assert_eq!(packer.adjusts, 0);
        // Log probabilities, with adjustments and without: the device's
        // (of the row before them).
        packer.token(2, 5, 2);
        assert!(on_device(&mut packer, 1, Pick::Argmax, &[banned], Some(3)));
        packer.token(3, 5, 3);
        assert!(on_device(&mut packer, 1, Pick::Argmax, &[], Some(3)));
        packer.picked_rows();
        let draw_at = |r: u64| (layout.draws + r * DRAW_WORDS as u64) as usize;
        let at = draw_at(2);
        assert_eq!(
            words[at..at + DRAW_WORDS],
            draw_words(None, 0, (1, 0), Some(3), None)
        );
        let at = draw_at(3);
        assert_eq!(
            words[at..at + DRAW_WORDS],
            draw_words(None, 1, (0, 0), Some(3), None)
        );
        assert_eq!(words[at + 8], 4);
        // A step of one sequence: all the room is its share.
        let mut words = vec![0u32; layout.words as usize];
        let mut packer = Packer::new(&mut words, layout, 1);
        packer.token(0, 5, 0);
        assert!(on_device(
            &mut packer,
            1,
            Pick::Draw(draw),
            &distinct(64),
            None
        ));
        assert_eq!(packer.adjusts, 64);
    }

    #[test]
    fn ids_sharing_an_adjustment_take_a_word_each_after_the_others_entries() {
        let layout = sparse_layout();
        let repeated = |id| Adjust {
            repetition: 1.3,
            ..Adjust::none(id)
        };
        let biased = Adjust {
            bias: -2.0,
            ..Adjust::none(7)
        };
        let banned = Adjust {
            ban: true,
            ..Adjust::none(51)
        };
        // 40 ids under one repetition penalty, a bias and a ban among them
        // (and an id past any vocabulary, left out): 2 rooms of their own,
        // 1 for the shared adjustment, 10 of ids. 42 entries in 13 of the
        // 16 rooms of a share (64 over 4 sequences).
        let list = |shared: u32| -> Vec<Adjust> {
            let mut list: Vec<Adjust> = (0..shared).map(|i| repeated(2 * i)).collect();
            list.extend([biased, banned, Adjust::none(1 << 31)]);
            list.sort_by_key(|a| a.id);
            list
        };
        let fits = list(40);
        let plan = AdjustPlan::of(&fits);
        assert_eq!((plan.counts(), plan.rooms()), ((2, 40), 13));
        let mut words = vec![0u32; layout.words as usize];
        let mut packer = Packer::new(&mut words, layout, 4);
        packer.token(0, 5, 0);
        assert!(on_device(&mut packer, 1, Pick::Argmax, &fits, None));
        // 61 ids: 19 rooms, past the share: a full row, and nothing of it
        // left in the buffer.
        packer.token(1, 5, 1);
        assert!(!on_device(&mut packer, 1, Pick::Argmax, &list(61), None));
        assert_eq!(packer.adjusts, 13);
        let past = (layout.adjusts + 13 * ADJUST_WORDS as u64) as usize;
        let end = (layout.adjusts + layout.adjusts_max * ADJUST_WORDS as u64) as usize;
        assert!(packer.words[past..end].iter().all(|&w| w == 0));
        packer.picked_rows();
        let at = (layout.draws + DRAW_WORDS as u64) as usize;
        assert_eq!(
            words[at..at + DRAW_WORDS],
            draw_words(None, 0, (2, 40), None, None)
        );
        let at = layout.adjusts as usize;
        let rooms: Vec<u32> = words[at..at + 13 * ADJUST_WORDS].to_vec();
        let mut want: Vec<u32> = [biased, banned]
            .iter()
            .flat_map(|a| a.words().unwrap())
            .collect();
        want.extend([0, 1.3f32.to_bits(), 0, 0]);
        want.extend((0..40).map(|i| 2 * i));
        assert_eq!(rooms, want);
        // A shared ban keeps its bit in the shared entry; fewer than three
        // sharing take their own rooms.
        let bans: Vec<Adjust> = (0..5)
            .map(|id| Adjust {
                ban: true,
                ..Adjust::none(id)
            })
            .collect();
        let (plan, out) = AdjustPlan::laid_out(&bans);
        assert_eq!((plan.counts(), plan.rooms()), ((0, 5), 3));
        assert_eq!(
            out,
            [1 << 31, 1.0f32.to_bits(), 0, 0, 0, 1, 2, 3, 4, 0, 0, 0]
        );
        let two = [repeated(1), repeated(2), biased];
        let plan = AdjustPlan::of(&two);
        assert_eq!((plan.counts(), plan.rooms()), ((3, 0), 3));
        // An adjustment of a third of the list, the rest each its own:
        // found whatever the order (a majority vote would end on a bias),
        // every entry of a short list read (two evenly apart would miss it).
        let mixed: Vec<Adjust> = (0..12)
            .map(|id| match id % 3 {
                1 => repeated(id),
                _ => Adjust {
                    bias: id as f32,
                    ..Adjust::none(id)
                },
            })
            .collect();
        assert_eq!(AdjustPlan::of(&mixed).counts(), (8, 4));
    }

    #[test]
    fn a_list_is_laid_out_in_one_pass_or_refused_with_nothing_left() {
        let repeated = |id: u32| Adjust {
            repetition: 1.3,
            ..Adjust::none(id)
        };
        let biased = |id: u32| Adjust {
            bias: id as f32,
            ..Adjust::none(id)
        };
        let mut ids = Vec::new();
        // Own entries past the room: refused at the first that does not
        // fit, the room zero again.
        let own: Vec<Adjust> = (0..6).map(biased).collect();
        let mut out = vec![0u32; 5 * ADJUST_WORDS];
        assert_eq!(AdjustPlan::lay_out(&own, &mut out, &mut ids), None);
        assert!(out.iter().all(|&w| w == 0));
        // Ids out of order (here a repeat) after some were written: refused, zero.
        let mut unordered: Vec<Adjust> = (0..4).map(biased).collect();
        unordered.push(biased(2));
        assert_eq!(AdjustPlan::lay_out(&unordered, &mut out, &mut ids), None);
        assert!(out.iter().all(|&w| w == 0));
        // Shared ids past the room (3 own, 1 shared entry and 5 rooms of
        // 17 ids: 9 rooms in 8): refused, zero.
        let mut both: Vec<Adjust> = (0..17).map(|i| repeated(2 * i)).collect();
        both.extend([1, 3, 5].map(biased));
        both.sort_by_key(|a| a.id);
        let mut eight = vec![0u32; 8 * ADJUST_WORDS];
        assert_eq!(AdjustPlan::lay_out(&both, &mut eight, &mut ids), None);
        assert!(eight.iter().all(|&w| w == 0));
        let (plan, laid) = AdjustPlan::laid_out(&both);
        assert_eq!((plan.counts(), plan.rooms()), ((3, 17), 9));
        let mut want: Vec<u32> = [1, 3, 5]
            .map(biased)
            .iter()
            .flat_map(|a| a.words().unwrap())
            .collect();
        want.extend([0, 1.3f32.to_bits(), 0, 0]);
        want.extend((0..17).map(|i| 2 * i));
        want.resize(9 * ADJUST_WORDS, 0);
        assert_eq!(laid, want);
        // The vote's adjustment shared by two only: every entry its own, in
        // the list's order.
        let two = [repeated(4), biased(5), repeated(6)];
        let (plan, laid) = AdjustPlan::laid_out(&two);
        assert_eq!((plan.counts(), plan.rooms()), ((3, 0), 3));
        let want: Vec<u32> = two.iter().flat_map(|a| a.words().unwrap()).collect();
        assert_eq!(laid, want);
    }

    #[test]
    fn the_gpu_checks_adjustments_fit_a_rows_share_at_128_sequences() {
        // Its row "3000 adjustments a row" times what it says: picked on the
        // device, not the whole row to the host.
        let share = ADJUSTS_PER_SEQ;
        for seq in [0, 1, 127] {
            let list = super::super::check::decode_adjusts(seq, 3000, 49_152);
            assert_eq!(list.len(), 3000);
            let plan = AdjustPlan::of(&list);
            assert_eq!(plan.counts(), (188, 2812));
            assert_eq!(plan.rooms(), 892);
            assert!(plan.rooms() <= share);
        }
    }

    #[test]
    fn a_prompts_scored_rows_are_gathered_after_the_full_rows_each_with_its_target() {
        let layout = sparse_layout();
        let mut words = vec![0u32; layout.words as usize];
        let mut packer = Packer::new(&mut words, layout, 3);
        let targets = [11, 12, 13];
        // Sequence 0: a prompt chunk of 5 tokens, its last 4 rows wanted,
        // the first 3 scored for the tokens after them, the last sampled.
        for i in 0..5 {
            packer.token(10 + i, i, 0);
        }
        let scores = PromptScores {
            targets: &targets,
            top: 2,
        };
        let given = packer.logits(4, Pick::Argmax, &[], None, scores);
        assert_eq!(
            given,
            Given {
                scored: 3,
                picked: true
            }
        );
        assert_eq!(given.on_device(), 4);
        // Sequence 1: a decode token, its row in full.
        packer.token(20, 9, 1);
        let given = packer.logits(1, Pick::Row, &[], None, PromptScores::NONE);
        assert_eq!(given, Given::default());
        // Sequence 2: a chunk of 2 tokens scored, nothing sampled.
        packer.token(30, 0, 2);
        packer.token(31, 1, 2);
        let scores = PromptScores {
            targets: &[31, 32],
            top: 0,
        };
        let given = packer.logits(2, Pick::Row, &[], None, scores);
        assert_eq!(
            given,
            Given {
                scored: 2,
                picked: false
            }
        );
        packer.picked_rows();
        assert_eq!(packer.counts.wanted, 7);
        let l = layout;
        let word = |i: usize| words[l.gather as usize + i];
        // The full row (token 5) first, then sequence 0's 3 scored and its
        // sampled, then sequence 2's two scored: step order.
        let gather: Vec<u32> = (0..7).map(word).collect();
        assert_eq!(gather, [5, 1, 2, 3, 4, 6, 7]);
        let draw = |r: usize| -> Vec<u32> {
            let at = l.draws as usize + r * DRAW_WORDS;
            words[at..at + DRAW_WORDS].to_vec()
        };
        assert!(draw(0).iter().all(|&w| w == 0), "a full row draws nothing");
        for (r, target) in [(1, 11), (2, 12), (3, 13)] {
            assert_eq!(draw(r), draw_words(None, 0, (0, 0), Some(2), Some(target)));
        }
        assert!(draw(4).iter().all(|&w| w == 0), "a greedy row: its argmax");
        for (r, target) in [(5, 31), (6, 32)] {
            assert_eq!(draw(r), draw_words(None, 0, (0, 0), Some(0), Some(target)));
            assert_eq!(draw(r)[8..10], [1, target + 1]);
        }
    }

    #[test]
    fn decode_splits_are_whole_tiles_within_their_bound_and_finer_only_at_a_small_batch() {
        let context = 8192;
        for kv_heads in [1, 2, 3, 8] {
            for seqs in [1, 2, 3, 4, 8, 32, 100, 128, 256] {
                let bound = decode_splits_max(seqs, kv_heads, context);
                for positions in 1..=context {
                    let span = decode_span(positions, seqs, kv_heads);
                    assert!(span.is_multiple_of(ATTENTION_TILE) && span <= SPLIT_POSITIONS);
                    // Never coarser than one split per SPLIT_POSITIONS.
                    assert!(positions.div_ceil(span) >= positions.div_ceil(SPLIT_POSITIONS));
                    assert!(
                        positions.div_ceil(span) <= bound,
                        "{positions} positions, {seqs} seqs, {kv_heads} heads: over {bound}"
                    );
                }
            }
        }
        // Batch 1 at depth 512 (SmolLM2: 3 KV heads): 17 blocks a head of at
        // most a tile (not 2 of 8 tiles and one of a position); at 4,096, 43
        // of at most 3 tiles (not 16 of 8 and one).
        assert_eq!(decode_span(513, 1, 3), 32);
        assert_eq!(decode_span(4097, 1, 3), 96);
        // Batch 128: the step's tokens fill the GPU; spans stay whole.
        assert_eq!(decode_span(4097, 128, 3), SPLIT_POSITIONS);
        assert_eq!(decode_splits_max(128, 3, 8192), 32);
        assert_eq!(decode_splits_max(1, 3, 8192), 64);
    }
}
