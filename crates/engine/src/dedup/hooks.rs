//! STUB (replaced at merge)
#![allow(unused)]
#[derive(Debug, Clone, Copy)]
pub struct HookGeometry {
    pub first_table: u64,
    pub parts_per_segment: u64,
    pub segments: u64,
}
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HookStats {
    pub entries: u64,
    pub capacity: u64,
    pub sample_bits: u8,
    pub memory_bytes: u64,
    pub evictions: u64,
    pub sweeps: u64,
    pub full: bool,
}
pub struct HookIndex;
impl HookIndex {
    pub fn new(budget_bytes: u64, max_useful: u64, geo: HookGeometry) -> HookIndex {
        HookIndex
    }
    pub fn sampled(&self, key: u64) -> bool {
        true
    }
    pub fn note(&mut self, key: u64, table: u32) {}
    pub fn lookup(&mut self, key: u64) -> Option<u32> {
        None
    }
    pub fn forget(&mut self, key: u64, table: u32) {}
    pub fn segment_freed(&mut self, segment: u64) {}
    pub fn stats(&self) -> HookStats {
        HookStats::default()
    }
    pub fn memory_bytes(&self) -> u64 {
        0
    }
}
