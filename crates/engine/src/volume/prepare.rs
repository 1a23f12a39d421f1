//! Preparing a write, on the caller's thread and outside the state lock:
//! the blocks are split into zero runs, dedup candidates (fingerprinted,
//! looked up in the index, verified byte for byte against the stored block)
//! and runs of data merged into units, each compressed with the codec the
//! policy picks (the compressibility probe sends incompressible data raw).
use super::window::Source;
use super::{Volume, Writer, BS};
use crate::codec::Codec;
use crate::dedup::{self, Fingerprint};
use crate::error::VolError;
use crate::policy::{self, CodecPolicy};
use crate::records::{decode_block_record, DecodedUnit};
use cvol_format::record::UNIT_BLOCKS_MAX;
use cvol_format::{CodecTag, EntryState, MapEntry};
use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A block or unit after compression, before it has a place in the log.
pub(in crate::volume) enum Prepared<'a> {
    Data {
        lba: u64,
        /// 1, or the blocks of a merged unit.
        nblocks: u32,
        codec: CodecTag,
        level: u8,
        payload: Cow<'a, [u8]>,
        payload_crc: u32,
        /// Fingerprint per block (0: none).
        fps: Vec<Fingerprint>,
    },
    Zero {
        lba: u64,
        nblocks: u32,
    },
    /// Content already stored, verified byte for byte: becomes a reference
    /// if the record is still live at commit.
    Dup {
        lba: u64,
        fp: Fingerprint,
        block: &'a [u8],
        target: DupTarget,
    },
}

/// How a run of blocks is stored.
enum Choice {
    Codec(Codec),
    /// As one raw unit, for background recompression (the CPU budget of
    /// inline compression is spent).
    Defer,
}

#[derive(Clone, Copy)]
pub(in crate::volume) enum DupTarget {
    /// A stored record (its owner-form entry and header LBA, from the
    /// index), and which part of the index named it.
    Record(MapEntry, u64, Source),
    /// The same content as an earlier block of this write (by LBA).
    Earlier(u64),
}

/// The dedup side of a write: a fingerprint per block (0: zero block, or
/// no dedup) and the verified target of each duplicate.
struct Duplicates {
    fps: Vec<Fingerprint>,
    targets: Vec<Option<DupTarget>>,
}

pub(in crate::volume) fn is_zero(b: &[u8]) -> bool {
    let words = b.chunks_exact(16);
    let rest = words.remainder();
    words
        .map(|c| u128::from_ne_bytes(c.try_into().expect("16 bytes")))
        .all(|w| w == 0)
        && rest.iter().all(|&x| x == 0)
}

impl Volume {
    /// The dedup fingerprint of each 4 KiB block of `data` (0 for a zero
    /// block, or every block when the volume has no dedup).
    pub(in crate::volume) fn fingerprints(&self, data: &[u8]) -> Vec<Fingerprint> {
        let Some(d) = &self.dedup else {
            return vec![0; data.len() / BS];
        };
        data.chunks_exact(BS)
            .map(|b| {
                if is_zero(b) {
                    0
                } else {
                    dedup::fingerprint(&d.seed, b)
                }
            })
            .collect()
    }

    /// The crc32c of a payload in the clear, which the log's header covers
    /// on a volume in the clear; 0 on an encrypted one, whose log takes the
    /// crc of the sealed payload itself (`Log::append`).
    pub(in crate::volume) fn payload_crc(&self, payload: &[u8]) -> u32 {
        match self.sb.is_encrypted() {
            true => 0,
            false => crc32c::crc32c(payload),
        }
    }

    /// Blocks per merged compression unit (the window writes are cut at):
    /// a power of two up to `UNIT_BLOCKS_MAX`, so that every unit lies
    /// inside one aligned window of that many blocks (the format's rule).
    pub(in crate::volume) fn unit_blocks(&self) -> u64 {
        let n = self.options.elastic.unit_blocks.clamp(1, UNIT_BLOCKS_MAX);
        u64::from(1u32 << n.ilog2())
    }

    /// Blocks per unit of background recompression: a power of two from
    /// `unit_blocks` to `UNIT_BLOCKS_MAX` (`ElasticConfig::recompress_unit_blocks`).
    pub(in crate::volume) fn recompress_unit_blocks(&self) -> u64 {
        let n = (self.options.elastic.recompress_unit_blocks).clamp(1, UNIT_BLOCKS_MAX);
        u64::from(1u32 << n.ilog2()).max(self.unit_blocks())
    }

    /// Splits a write into records to commit: zero runs, blocks whose
    /// content is already stored (verified dedup candidates), and compressed
    /// blocks. Runs on the caller's thread, without the state lock.
    pub(super) fn prepare<'a>(
        &self,
        lba: u64,
        data: &'a [u8],
        who: Writer,
    ) -> Result<Vec<Prepared<'a>>, VolError> {
        assert!(!data.is_empty() && data.len().is_multiple_of(BS));
        let dups = self.find_duplicates(lba, data)?;
        // Zero runs, dedup references, and runs of data merged into units:
        // contiguous blocks inside one aligned window of `unit` blocks.
        let unit = self.unit_blocks();
        let nblocks = data.len() / BS;
        let block = |i: usize| &data[i * BS..(i + 1) * BS];
        let mut out: Vec<Prepared<'a>> = Vec::with_capacity(nblocks);
        let mut run: Option<usize> = None;
        let flush_run = |out: &mut Vec<Prepared<'a>>, run: &mut Option<usize>, end: usize| {
            if let Some(start) = run.take() {
                out.extend(self.compress_run(
                    lba + start as u64,
                    &data[start * BS..end * BS],
                    &dups.fps[start..end],
                    who,
                ));
            }
        };
        for i in 0..nblocks {
            let (l, b) = (lba + i as u64, block(i));
            if is_zero(b) {
                flush_run(&mut out, &mut run, i);
                push_zero(&mut out, l);
            } else if let Some(target) = dups.targets[i] {
                flush_run(&mut out, &mut run, i);
                let fp = dups.fps[i];
                out.push(Prepared::Dup {
                    lba: l,
                    fp,
                    block: b,
                    target,
                });
            } else {
                if run.is_some() && l % unit == 0 {
                    flush_run(&mut out, &mut run, i);
                }
                run.get_or_insert(i);
            }
        }
        flush_run(&mut out, &mut run, nblocks);
        assert_covers(&out, lba, nblocks as u64);
        Ok(out)
    }

    /// Fingerprints the write's non-zero blocks, finds candidates (one hold
    /// of the index lock; repeats inside the write by fingerprint and
    /// bytes) and verifies them outside every lock against the stored
    /// block. Nothing without dedup.
    fn find_duplicates(&self, lba: u64, data: &[u8]) -> Result<Duplicates, VolError> {
        let nblocks = data.len() / BS;
        let block = |i: usize| &data[i * BS..(i + 1) * BS];
        let Some(d) = &self.dedup else {
            return Ok(Duplicates {
                fps: vec![0; nblocks],
                targets: vec![None; nblocks],
            });
        };
        let fps = self.fingerprints(data);
        let mut found = self.window_lookup(d, lba, data, &fps)?;
        let lookups = fps.iter().filter(|&&fp| fp != 0).count();
        self.counters
            .dedup_lookups
            .fetch_add(lookups as u64, Ordering::Relaxed);
        // Verify outside every lock: the stored block must equal this one.
        for (i, t) in found.targets.iter_mut().enumerate() {
            if let Some(DupTarget::Record(e, ..)) = *t {
                if self.stored_block(e).as_deref() != Some(block(i)) {
                    self.count_verify_reject();
                    *t = None;
                }
            }
        }
        Ok(Duplicates {
            fps,
            targets: found.targets,
        })
    }

    /// How to store a run of blocks: raw if the probe finds it
    /// incompressible, else the fixed codec or the auto policy's choice
    /// for the current load, or deferred (a raw unit) when the load is busy
    /// and inline compression has used its CPU budget (runs of 2+ blocks).
    fn choose_codec(&self, data: &[u8], who: Writer) -> Choice {
        let n = (data.len() / BS) as u64;
        let es = &self.counters.elastic;
        match self.policy {
            CodecPolicy::Fixed(Codec::None) => Choice::Codec(Codec::None),
            _ if !policy::probe_compressible(data) => {
                es.probe_raw_blocks.fetch_add(n, Ordering::Relaxed);
                Choice::Codec(Codec::None)
            }
            CodecPolicy::Fixed(c) => Choice::Codec(c),
            CodecPolicy::Auto { .. } => {
                let load = match who {
                    Writer::Background => policy::Load::Idle,
                    Writer::Client => self.activity.load.load(&self.options.elastic),
                };
                if load == policy::Load::Busy
                    && n >= 2
                    && !self.activity.inline_budget.allows()
                    && self.activity.defer_room.load(Ordering::Relaxed)
                {
                    return Choice::Defer;
                }
                // The machine's CPU busy is a busy load for the codec (the
                // CPU is the bottleneck), never a reason to defer.
                let load = match load {
                    policy::Load::Busy => load,
                    _ if who == Writer::Client
                        && self.activity.load.cpu_busy(&self.options.elastic) =>
                    {
                        es.auto_cpu_busy.fetch_add(1, Ordering::Relaxed);
                        policy::Load::Busy
                    }
                    _ => load,
                };
                es.count_auto_choice(load);
                Choice::Codec(self.options.elastic.codec_at(load))
            }
        }
    }

    /// Compresses a run of contiguous blocks (inside one unit window) into
    /// one unit record, or single-block records when it is one block or
    /// does not compress; or stores it as one raw unit when compression is
    /// deferred.
    fn compress_run<'a>(
        &self,
        lba: u64,
        data: &'a [u8],
        fps: &[Fingerprint],
        who: Writer,
    ) -> Vec<Prepared<'a>> {
        let es = &self.counters.elastic;
        let out = match self.choose_codec(data, who) {
            Choice::Defer => {
                let n = data.len() / BS;
                es.deferred_units.fetch_add(1, Ordering::Relaxed);
                es.deferred_blocks.fetch_add(n as u64, Ordering::Relaxed);
                vec![Prepared::Data {
                    lba,
                    nblocks: n as u32,
                    codec: CodecTag::None,
                    level: 0,
                    payload_crc: self.payload_crc(data),
                    payload: Cow::Borrowed(data),
                    fps: fps.to_vec(),
                }]
            }
            Choice::Codec(codec) => {
                let clock = self.activity.inline_budget.clock();
                let t = clock.now_ns();
                let out = self.compress_run_with(lba, data, fps, codec, self.unit_blocks());
                let spent = clock.now_ns().saturating_sub(t);
                self.activity.inline_budget.spend(spent);
                out
            }
        };
        if let [Prepared::Data { nblocks, .. }] = out[..] {
            if nblocks > 1 {
                es.units_written.fetch_add(1, Ordering::Relaxed);
                es.unit_blocks_written
                    .fetch_add(u64::from(nblocks), Ordering::Relaxed);
            }
        }
        out
    }

    pub(in crate::volume) fn compress_run_with<'a>(
        &self,
        lba: u64,
        data: &'a [u8],
        fps: &[Fingerprint],
        codec: Codec,
        unit: u64,
    ) -> Vec<Prepared<'a>> {
        let n = data.len() / BS;
        assert!(n >= 1 && n <= UNIT_BLOCKS_MAX as usize && fps.len() == n);
        assert!(unit.is_power_of_two() && unit <= u64::from(UNIT_BLOCKS_MAX));
        assert!(
            lba / unit == (lba + n as u64 - 1) / unit,
            "a unit stays inside one aligned window"
        );
        let compressed = codec.compress(data);
        match compressed {
            Some(c) => {
                vec![Prepared::Data {
                    lba,
                    nblocks: n as u32,
                    codec: codec.tag(),
                    level: codec.level(),
                    payload_crc: self.payload_crc(&c),
                    payload: Cow::Owned(c),
                    fps: fps.to_vec(),
                }]
            }
            // Stored raw, one record per block: a raw unit would only cost
            // read amplification.
            None => (0..n)
                .map(|i| {
                    let b = &data[i * BS..(i + 1) * BS];
                    Prepared::Data {
                        lba: lba + i as u64,
                        nblocks: 1,
                        codec: CodecTag::None,
                        level: 0,
                        payload_crc: self.payload_crc(b),
                        payload: Cow::Borrowed(b),
                        fps: vec![fps[i]],
                    }
                })
                .collect(),
        }
    }

    /// One block, compressed on its own (a dedup candidate that lost its
    /// target at commit).
    pub(super) fn compress_block<'a>(
        &self,
        lba: u64,
        block: &'a [u8],
        fp: Fingerprint,
        who: Writer,
    ) -> Prepared<'a> {
        self.compress_run(lba, block, &[fp], who)
            .pop()
            .expect("one block makes one record")
    }

    /// The decompressed block of the record `e` names, for dedup
    /// verification: from the read cache, the open segment's buffer or the
    /// store. None if it cannot be read or is not that record any more.
    fn stored_block(&self, e: MapEntry) -> Option<Arc<[u8]>> {
        let EntryState::Data {
            offset, len, unit, ..
        } = e.state_valid()
        else {
            return None;
        };
        // As a ref entry: the record may name any LBA; its crc must match.
        let as_ref = e.as_ref_entry();
        let mut out = vec![0u8; BS];
        if unit {
            if let Some(u) = self.unit_cached(offset, len, 0, as_ref) {
                u.copy_block(0, as_ref, &mut out).ok()?;
                return Some(Arc::from(out));
            }
        }
        if let Some(b) = self.caches.cached_block(offset, e.crc, &self.counters) {
            return Some(b);
        }
        let rec = self.record_bytes(offset, len).ok()?;
        if unit {
            let u = Arc::new(DecodedUnit::decode(self.sb.sealer(), &rec).ok()?);
            u.copy_block(0, as_ref, &mut out).ok()?;
            self.caches.unit.insert((offset, len), u);
        } else {
            decode_block_record(self.sb.sealer(), 0, as_ref, &rec, &mut out).ok()?;
        }
        let b: Arc<[u8]> = Arc::from(out);
        self.caches.insert_block(offset, e.crc, &b, &self.counters);
        Some(b)
    }

    /// The bytes of the record at `offset`: from the open segment's buffer,
    /// else read from the store.
    fn record_bytes(&self, offset: u64, len: u32) -> Result<Vec<u8>, VolError> {
        let buffered = self
            .lock_state()?
            .log
            .buffered(offset, len as usize)
            .map(<[u8]>::to_vec);
        match buffered {
            Some(r) => Ok(r),
            None => {
                let mut r = vec![0u8; len as usize];
                self.storage.read_at(offset, &mut r).map_err(VolError::Io)?;
                Ok(r)
            }
        }
    }
}

/// The prepared items cover `nblocks` from `lba` exactly, in order.
fn assert_covers(items: &[Prepared<'_>], lba: u64, nblocks: u64) {
    let mut next = lba;
    for p in items {
        let (first, n) = match p {
            Prepared::Data { lba, nblocks, .. } | Prepared::Zero { lba, nblocks } => {
                (*lba, u64::from(*nblocks))
            }
            Prepared::Dup { lba, .. } => (*lba, 1),
        };
        assert_eq!(first, next, "prepared items leave a gap or overlap");
        next += n;
    }
    assert_eq!(next, lba + nblocks, "prepared items cover the write");
}

/// Adds block `l` to the zero run it continues, or starts a new one.
fn push_zero(out: &mut Vec<Prepared<'_>>, l: u64) {
    if let Some(Prepared::Zero { lba: zl, nblocks }) = out.last_mut() {
        if *zl + u64::from(*nblocks) == l {
            *nblocks += 1;
            return;
        }
    }
    out.push(Prepared::Zero { lba: l, nblocks: 1 });
}
