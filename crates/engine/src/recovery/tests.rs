//! The rooms of recovery depend in one direction: each uses only the rooms
//! listed before it (the order of `mod.rs`'s header), and none reaches
//! into `mod.rs`, so no circle can form between them.

/// The rooms, bottom first, with their source.
const ROOMS: [(&str, &str); 10] = [
    ("superblock", include_str!("superblock.rs")),
    ("scan", include_str!("scan.rs")),
    ("certified", include_str!("certified.rs")),
    ("outcome", include_str!("outcome.rs")),
    ("chain", include_str!("chain.rs")),
    ("dir_records", include_str!("dir_records.rs")),
    ("checkpoint", include_str!("checkpoint.rs")),
    ("search", include_str!("search.rs")),
    ("salvage_walk", include_str!("salvage_walk.rs")),
    ("salvage", include_str!("salvage.rs")),
];

/// The rooms a source names through `super::` (anything else it names
/// there is `mod.rs` itself, reported as "mod").
fn rooms_used(text: &str) -> Vec<&str> {
    text.match_indices("super::")
        .map(|(at, m)| {
            let rest = &text[at + m.len()..];
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            let name = &rest[..end];
            match ROOMS.iter().find(|(room, _)| *room == name) {
                Some((room, _)) if rest[end..].starts_with("::") => *room,
                _ => "mod",
            }
        })
        .collect()
}

#[test]
fn each_room_uses_only_the_rooms_before_it() {
    let mut wrong = Vec::new();
    for (i, (room, text)) in ROOMS.iter().enumerate() {
        for used in rooms_used(text) {
            let before = ROOMS[..i].iter().any(|(r, _)| *r == used);
            if !before {
                wrong.push(format!("{room} uses {used}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "upward uses between recovery's rooms: {wrong:?}"
    );
}

#[test]
fn the_check_sees_an_upward_use() {
    assert_eq!(rooms_used("use super::chain::Start;"), ["chain"]);
    assert_eq!(rooms_used("use super::Recovered;"), ["mod"]);
}
