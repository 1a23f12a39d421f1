//! A set of sectors of one chunk: empty, full, or a bitmap in between
//! (most chunks are empty or full, so most take no memory).

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bits {
    None,
    All,
    Some(Box<[u64]>),
}

impl Bits {
    fn words(n: u64) -> usize {
        n.div_ceil(64) as usize
    }

    fn expand(&mut self, n: u64) -> &mut [u64] {
        if !matches!(self, Bits::Some(_)) {
            let fill = if matches!(self, Bits::All) { !0 } else { 0 };
            let mut w = vec![fill; Bits::words(n)];
            if !n.is_multiple_of(64) {
                // Bits past the end stay clear (`settle` compares words).
                *w.last_mut().expect("n > 0") &= (1u64 << (n % 64)) - 1;
            }
            *self = Bits::Some(w.into_boxed_slice());
        }
        match self {
            Bits::Some(w) => w,
            _ => unreachable!("just expanded"),
        }
    }

    fn settle(&mut self, n: u64) {
        if let Bits::Some(w) = self {
            let full = (0..n).all(|i| w[(i / 64) as usize] >> (i % 64) & 1 == 1);
            if full {
                *self = Bits::All;
            } else if w.iter().all(|&x| x == 0) {
                *self = Bits::None;
            }
        }
    }

    pub fn get(&self, i: u64) -> bool {
        match self {
            Bits::None => false,
            Bits::All => true,
            Bits::Some(w) => w[(i / 64) as usize] >> (i % 64) & 1 == 1,
        }
    }

    /// Sets or clears sectors `[from, to)` of a chunk of `n` sectors.
    pub fn assign(&mut self, from: u64, to: u64, value: bool, n: u64) {
        debug_assert!(from <= to && to <= n);
        if from == 0 && to == n {
            *self = if value { Bits::All } else { Bits::None };
            return;
        }
        if from == to || matches!((&*self, value), (Bits::All, true) | (Bits::None, false)) {
            return;
        }
        let w = self.expand(n);
        for i in from..to {
            let (word, bit) = ((i / 64) as usize, i % 64);
            if value {
                w[word] |= 1 << bit;
            } else {
                w[word] &= !(1 << bit);
            }
        }
        self.settle(n);
    }

    pub fn is_empty(&self) -> bool {
        matches!(self, Bits::None)
    }

    pub fn is_full(&self) -> bool {
        matches!(self, Bits::All)
    }

    /// Runs `[a, b)` within `[from, to)` whose sectors are `value`.
    pub fn runs(&self, from: u64, to: u64, value: bool) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        match (self, value) {
            (Bits::All, true) | (Bits::None, false) => {
                if from < to {
                    out.push((from, to));
                }
            }
            (Bits::All, false) | (Bits::None, true) => {}
            (Bits::Some(_), _) => {
                for i in from..to {
                    if self.get(i) == value {
                        match out.last_mut() {
                            Some(r) if r.1 == i => r.1 = i + 1,
                            _ => out.push((i, i + 1)),
                        }
                    }
                }
            }
        }
        out
    }

    /// How many of the `n` sectors are set.
    pub fn count(&self, n: u64) -> u64 {
        match self {
            Bits::None => 0,
            Bits::All => n,
            Bits::Some(w) => (0..n)
                .filter(|&i| w[(i / 64) as usize] >> (i % 64) & 1 == 1)
                .count() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_follow_assignments() {
        let n = 200;
        let mut b = Bits::None;
        b.assign(10, 20, true, n);
        b.assign(15, 17, false, n);
        assert_eq!(b.runs(0, n, true), vec![(10, 15), (17, 20)]);
        assert_eq!(b.runs(12, 18, false), vec![(15, 17)]);
        assert_eq!(b.count(n), 8);
        b.assign(0, n, true, n);
        assert!(b.is_full());
        b.assign(0, 199, false, n);
        b.assign(199, 200, false, n);
        assert!(b.is_empty(), "a bitmap with nothing set settles to None");
        b.assign(0, 100, true, n);
        b.assign(100, 200, true, n);
        assert!(b.is_full(), "a bitmap with everything set settles to All");
    }
}
