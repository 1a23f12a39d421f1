//! What sealing and opening a record costs, per cipher and payload size
//! (best of 5): `cargo run --release -p cvol-format --example seal_bench`.
use cvol_format::record::{RecordHeader, RecordKind};
use cvol_format::seal::{Cipher, Sealer, SEAL_AAD_BYTES, SEAL_TAG_BYTES};
use cvol_format::CodecTag;
use std::time::Instant;

fn main() {
    println!("| cipher | payload | seal MB/s | open MB/s |");
    println!("|---|---|---|---|");
    for cipher in Cipher::ALL {
        let s = Sealer::new(cipher, &[9; 32]);
        for len in [1024usize, 4096, 16384, 65536] {
            let payload: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let mut h = RecordHeader {
                kind: RecordKind::Data,
                codec: CodecTag::None,
                level: 0,
                mask: 0,
                volume_tag: 1,
                epoch: 1,
                seq: 1,
                lba: 0,
                nblocks: 1,
                payload_len: (len + SEAL_TAG_BYTES) as u32,
                crc: 0,
                sealed: true,
            };
            let aad = h.encode_with_crc(0);
            let mut out = vec![0u8; len + SEAL_TAG_BYTES];
            let n = (256 << 20) / len;
            let (mut best_seal, mut best_open) = (f64::MAX, f64::MAX);
            for _ in 0..5 {
                let t = Instant::now();
                for i in 0..n {
                    s.seal_record(&aad[..SEAL_AAD_BYTES], 1, i as u64, &payload, &mut out);
                }
                best_seal = best_seal.min(t.elapsed().as_secs_f64());
                s.seal_record(&aad[..SEAL_AAD_BYTES], 1, 1, &payload, &mut out);
                let rec = cvol_format::record::encode_record(&mut h, &out);
                let t = Instant::now();
                for _ in 0..n {
                    std::hint::black_box(s.open_record(&h, &rec).expect("opens"));
                }
                best_open = best_open.min(t.elapsed().as_secs_f64());
            }
            let mbs = |t: f64| (n * len) as f64 / t / 1e6;
            println!(
                "| {} | {len} | {:.0} | {:.0} |",
                cipher.name(),
                mbs(best_seal),
                mbs(best_open)
            );
        }
    }
}
