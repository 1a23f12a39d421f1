//! The order a commit's DATA records are appended in under page packing
//! (the bin-packing of [SSD-packing], Zuck et al.): each record goes to the first 4 KiB page bin
//! with room for it, starting with the rest of the head's open page;
//! `PageSorted` considers them largest first (first-fit decreasing).
//!
//! The bins are placed one after another, so appending the records bin
//! by bin reproduces the packing while the log stays in seq order (what
//! roll-forward follows). The window is one commit's records: a record
//! is never placed behind a later one. `Log::append` decides the actual
//! place (`Packing::place`); this only chooses the order.
use cvol_format::superblock::{Packing, PACKING_PAGE_BYTES};

/// One bin: the room left in it and the records placed in it.
struct Bin {
    room: usize,
    records: Vec<usize>,
}

/// The order to append records of these total sizes (header and payload)
/// in, with the head `fill` bytes into its segment: indices into `sizes`.
/// Compact packing keeps the given order.
pub fn commit_order(packing: Packing, fill: usize, sizes: &[usize]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    if !packing.paged() || sizes.len() < 2 {
        return order;
    }
    if packing == Packing::PageSorted {
        // Stable: equal sizes keep their order.
        order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]));
    }
    let page = PACKING_PAGE_BYTES as usize;
    let open = (page - fill % page) % page;
    let mut bins = vec![Bin {
        room: open,
        records: Vec::new(),
    }];
    for i in order {
        let len = sizes[i];
        match bins.iter_mut().find(|b| b.room >= len) {
            Some(b) => {
                b.room -= len;
                b.records.push(i);
            }
            // A new bin of as many pages as the record needs; its last
            // page's rest is room for smaller ones.
            None => bins.push(Bin {
                room: len.div_ceil(page) * page - len,
                records: vec![i],
            }),
        }
    }
    let out: Vec<usize> = bins.into_iter().flat_map(|b| b.records).collect();
    debug_assert_eq!(out.len(), sizes.len());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes of padding appending `sizes` in `order` from `fill`
    /// costs, as `Log::append` would place them (within one segment).
    fn padding(packing: Packing, fill: usize, sizes: &[usize], order: &[usize]) -> u64 {
        let mut at = fill as u64;
        let mut pad = 0;
        for &i in order {
            let len = sizes[i] as u64;
            let p = packing.place(at, len);
            pad += p - at;
            at = p + len;
        }
        pad
    }

    #[test]
    fn compact_keeps_the_order() {
        let sizes = [3000, 3000, 1000, 1000];
        assert_eq!(commit_order(Packing::Compact, 0, &sizes), [0, 1, 2, 3]);
    }

    #[test]
    fn first_fit_fills_a_page_with_a_later_small_record() {
        let sizes = [3000, 3000, 1000, 1000];
        let order = commit_order(Packing::Page, 0, &sizes);
        assert_eq!(order, [0, 2, 1, 3]);
        let given: Vec<usize> = (0..4).collect();
        assert!(
            padding(Packing::Page, 0, &sizes, &order) < padding(Packing::Page, 0, &sizes, &given)
        );
    }

    #[test]
    fn sorted_places_the_largest_first_and_pads_no_more_than_first_fit() {
        let sizes = [1000, 2500, 1500, 3000, 600, 3500, 500];
        let sorted = commit_order(Packing::PageSorted, 0, &sizes);
        assert_eq!(sorted[0], 5, "the largest record first");
        let ff = commit_order(Packing::Page, 0, &sizes);
        for order in [&sorted, &ff] {
            let mut seen = order.to_vec();
            seen.sort();
            assert_eq!(seen, (0..sizes.len()).collect::<Vec<_>>(), "a permutation");
        }
        assert!(
            padding(Packing::PageSorted, 0, &sizes, &sorted)
                <= padding(Packing::Page, 0, &sizes, &ff)
        );
    }

    #[test]
    fn the_rest_of_the_open_page_is_the_first_bin() {
        // 900 bytes left in the open page: the 800-byte record goes there.
        let sizes = [2000, 800];
        assert_eq!(commit_order(Packing::Page, 4096 - 900, &sizes), [1, 0]);
        assert_eq!(
            padding(Packing::Page, 4096 - 900, &sizes, &[1, 0]),
            100,
            "only the open page's last 100 bytes"
        );
    }

    #[test]
    fn records_longer_than_a_page_leave_their_last_page_as_room() {
        // A raw block (4096 + 44) leaves 4052 bytes of its second page.
        let sizes = [4140, 3000, 1000];
        let order = commit_order(Packing::Page, 0, &sizes);
        assert_eq!(order, [0, 1, 2]);
        assert_eq!(padding(Packing::Page, 0, &sizes, &order), 0);
    }
}
