//! STUB (replaced at merge)
#![allow(unused)]
use cvol_format::fprints::FpRow;
use cvol_format::MapEntry;
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheHit {
    pub entry: MapEntry,
    pub owner: u64,
    pub table: u32,
    pub row: u32,
    pub rows: u32,
}
pub struct TableCache;
impl TableCache {
    pub fn new(budget_bytes: u64) -> TableCache {
        TableCache
    }
    pub fn contains(&self, table: u32) -> bool {
        false
    }
    pub fn insert(&mut self, table: u32, rows: std::sync::Arc<[FpRow]>) {}
    pub fn lookup(&mut self, key: u64) -> Option<CacheHit> {
        None
    }
    pub fn remove(&mut self, table: u32) {}
    pub fn remove_range(&mut self, tables: std::ops::Range<u32>) {}
    pub fn want(&mut self, table: u32) {}
    pub fn take_wanted(&mut self) -> Option<u32> {
        None
    }
    pub fn tables(&self) -> u64 {
        0
    }
    pub fn memory_bytes(&self) -> u64 {
        0
    }
}
