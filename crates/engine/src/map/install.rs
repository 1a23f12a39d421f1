//! How open names the map's pages (`BlockMap::install_*`): read into
//! memory, or left on disk with their records named, a page or a whole
//! directory block at a time.
use super::{BlockMap, DirBlock, Page, DIR_SLOTS};
use cvol_format::checkpoint::PageRef;

impl BlockMap {
    /// Installs page `p` as read from record `r` at open (clean).
    pub fn install_loaded(&mut self, p: usize, page: Page, r: PageRef) {
        assert!(page.used() > 0 && !self.pages.has(p));
        self.insert(p, page);
        self.allocate(p);
        self.set_ref(p, Some(r));
    }

    /// Names page `p`'s record at open without reading it (the page stays
    /// on disk until faulted in).
    pub fn install_unread(&mut self, p: usize, r: PageRef) {
        assert!(!self.pages.has(p));
        self.allocate(p);
        self.set_ref(p, Some(r));
    }

    /// Counts a page record open read to verify it (`CacheCounts`).
    pub fn count_verified_at_open(&mut self) {
        self.counts.verified_at_open += 1;
    }

    /// `install_unread` of pages (page, record) of one directory block that
    /// has none named yet, in ascending page order (a MAP_DIR's list): its
    /// references taken in one go at open.
    pub fn install_unread_block(&mut self, pages: &[(u64, PageRef)]) {
        let Some(&(first, _)) = pages.first() else {
            return;
        };
        let b = first as usize / DIR_SLOTS;
        let sorted = pages.windows(2).all(|w| w[0].0 < w[1].0);
        let last_in_b = pages[pages.len() - 1].0 as usize / DIR_SLOTS == b;
        if self.dirs[b].is_some() || !sorted || !last_in_b {
            pages
                .iter()
                .for_each(|&(p, r)| self.install_unread(p as usize, r));
            return;
        }
        let mut refs = Vec::with_capacity(pages.len());
        for &(p, r) in pages {
            let p = p as usize;
            assert!(!self.pages.has(p));
            self.allocate(p);
            refs.push(((p % DIR_SLOTS) as u16, r));
        }
        self.dirs[b] = Some(Box::new(DirBlock {
            refs,
            packed: None,
            record: None,
            list: None,
            dirty: true,
            holds: None,
        }));
    }

    /// Names the MAP_DIR record of directory block `b` at open (clean),
    /// and that of its list if the list lies apart.
    pub fn install_dir_record(&mut self, b: usize, r: PageRef, list: Option<PageRef>) {
        if let Some(d) = self.dirs[b].as_mut() {
            d.record = Some(r);
            d.list = list;
            d.dirty = false;
            d.holds = None;
        }
    }
}
