//! Needle in a haystack over real text (the multi-document evaluation's second task,
//! `docs/method.md` §5.4): each item hides one invented fact ("The secret number of the lantern is
//! 482913.") at a sentence boundary inside one paragraph of WikiText-2's validation text, among 3-7
//! other paragraphs of it, and asks for the number. The items are [`MultiDocItem`]s, so the
//! multi-document evaluation answers them in every mode unchanged; the answer is a number the model
//! cannot know from anywhere but the needle's document.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::data::QaItem;
use super::multidoc::MultiDocItem;

/// Words per haystack paragraph (about 130 tokens), cut at a sentence end when there is one.
pub const PARAGRAPH_WORDS: usize = 100;

/// What the needles are about: the key of each item is one of these.
const KEYS: [&str; 24] = [
    "lantern",
    "harbour",
    "orchard",
    "violin",
    "glacier",
    "library",
    "compass",
    "meadow",
    "furnace",
    "lighthouse",
    "cathedral",
    "canyon",
    "telescope",
    "vineyard",
    "workshop",
    "fountain",
    "monastery",
    "windmill",
    "observatory",
    "quarry",
    "bridge",
    "garden",
    "tower",
    "archive",
];

/// WikiText's spacing undone where it splits words and numbers (` @-@ `, ` @,@ `, ` @.@ `) and
/// before punctuation, so that the paragraphs read as ordinary text.
fn detokenize(line: &str) -> String {
    let mut s = line
        .trim()
        .replace(" @-@ ", "-")
        .replace(" @,@ ", ",")
        .replace(" @.@ ", ".");
    for p in [",", ".", ";", ":", ")", "'s"] {
        s = s.replace(&format!(" {p}"), p);
    }
    s.replace("( ", "(")
}

/// The body paragraphs of `text` (WikiText's lines that are not headings) of at least
/// [`PARAGRAPH_WORDS`] words, each cut to about that many at a sentence end.
pub fn haystack_paragraphs(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('='))
        .map(detokenize)
        .filter(|l| l.split_whitespace().count() >= PARAGRAPH_WORDS)
        .map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let mut cut = PARAGRAPH_WORDS;
            // Extend to the sentence's end, within a bound.
            while cut < words.len() && cut < PARAGRAPH_WORDS + 40 && !words[cut - 1].ends_with('.')
            {
                cut += 1;
            }
            words[..cut].join(" ")
        })
        .collect()
}

/// `needle` inserted after a sentence of `paragraph` chosen by `rng` (or at its start).
fn insert_needle(paragraph: &str, needle: &str, rng: &mut StdRng) -> String {
    let words: Vec<&str> = paragraph.split_whitespace().collect();
    let ends: Vec<usize> = (0..words.len())
        .filter(|&i| words[i].ends_with('.') && i + 1 < words.len())
        .map(|i| i + 1)
        .collect();
    let at = ends.choose(rng).copied().unwrap_or(0);
    let mut out: Vec<&str> = words[..at].to_vec();
    out.push(needle);
    out.extend(&words[at..]);
    out.join(" ")
}

/// `n` seeded needle items over the paragraphs of `text`, each with `distractors` (a range,
/// inclusive) other paragraphs, shuffled. Fewer when the text has too few paragraphs.
pub fn needle_items(
    text: &str,
    n: usize,
    (fewest, most): (usize, usize),
    seed: u64,
) -> Vec<MultiDocItem> {
    let paragraphs = haystack_paragraphs(text);
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6e65_6564_6c65);
    let most = most.max(fewest);
    if paragraphs.len() <= most {
        return Vec::new();
    }
    (0..n)
        .map(|i| {
            let key = KEYS[rng.gen_range(0..KEYS.len())];
            let number = rng.gen_range(100_000..1_000_000u32).to_string();
            let needle = format!("The secret number of the {key} is {number}.");
            let k = rng.gen_range(fewest..=most);
            let picked: Vec<&String> = paragraphs.choose_multiple(&mut rng, k + 1).collect();
            let context = insert_needle(picked[0], &needle, &mut rng);
            let mut documents: Vec<String> = picked[1..].iter().map(|p| p.to_string()).collect();
            documents.push(context.clone());
            documents.shuffle(&mut rng);
            let gold = documents
                .iter()
                .position(|d| *d == context)
                .unwrap_or_default();
            MultiDocItem {
                qa: QaItem {
                    id: format!("needle-{seed}-{i}"),
                    context,
                    question: format!("What is the secret number of the {key}?"),
                    answers: vec![number],
                    article: 0,
                },
                documents,
                gold,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str =
        " = Title = \n Alpha beta , gamma @-@ delta 1 @,@ 000 . Second sentence here . \n";

    #[test]
    fn wikitext_spacing_is_undone() {
        assert_eq!(
            detokenize(" Alpha beta , gamma @-@ delta 1 @,@ 000 . ( x ) "),
            "Alpha beta, gamma-delta 1,000. (x)"
        );
    }

    #[test]
    fn short_texts_give_no_items() {
        assert!(haystack_paragraphs(TEXT).is_empty());
        assert!(needle_items(TEXT, 3, (3, 7), 0).is_empty());
    }

    #[test]
    fn a_needle_goes_between_sentences() {
        let mut rng = StdRng::seed_from_u64(1);
        let p = "One two. Three four. Five six.";
        let out = insert_needle(p, "N.", &mut rng);
        assert!(
            [
                "One two. N. Three four. Five six.",
                "One two. Three four. N. Five six."
            ]
            .contains(&out.as_str()),
            "{out}"
        );
    }
}
