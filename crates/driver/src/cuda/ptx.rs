//! What a PTX image says of its kernels' parameters: how many each entry takes. Read when a
//! module is loaded, so that reading a captured kernel node's arguments asks the driver
//! only about parameters that exist (`cuFuncGetParamInfo` past the last one fails, and a
//! failing call on a hot path is noise under compute-sanitizer and the driver's error
//! callbacks). Images that are not PTX text (cubin, fatbin) say nothing here.
use rustc_hash::FxHashMap as HashMap;

/// The parameter count of every `.entry` in `image`, by name; empty when `image` is not
/// PTX text.
pub(super) fn entry_param_counts(image: &[u8]) -> HashMap<String, usize> {
    let text = match std::str::from_utf8(image.strip_suffix(&[0]).unwrap_or(image)) {
        Ok(text) => text,
        Err(_) => return HashMap::default(),
    };
    let mut counts = HashMap::default();
    let mut rest = text;
    while let Some(at) = find_directive(rest, ".entry") {
        rest = rest[at + ".entry".len()..].trim_start();
        let name_end = rest
            .find(|c: char| c.is_whitespace() || c == '(' || c == '{')
            .unwrap_or(rest.len());
        let name = &rest[..name_end];
        rest = rest[name_end..].trim_start();
        let count = match rest.strip_prefix('(') {
            Some(list) => {
                let close = list.find(')').unwrap_or(list.len());
                let count = list[..close].matches(".param").count();
                rest = &list[close..];
                count
            }
            None => 0,
        };
        if !name.is_empty() {
            counts.insert(name.to_string(), count);
        }
    }
    counts
}

/// The position of `directive` as a word (not a prefix of a longer one, not in a comment
/// line) in `text`.
fn find_directive(text: &str, directive: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = text[from..].find(directive) {
        let at = from + i;
        let end = at + directive.len();
        let word_ends = text[end..].starts_with(|c: char| c.is_whitespace());
        let line = &text[text[..at].rfind('\n').map_or(0, |n| n + 1)..at];
        if word_ends && !line.contains("//") {
            return Some(at);
        }
        from = end;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_parameters_of_each_entry() {
        let ptx = "//\n// .entry in a comment(.param .u64 x)\n.version 8.5\n.target sm_90\n\
            .visible .entry _Z3addPfS_i(\n\t.param .u64 .ptr .align 1 _Z3addPfS_i_param_0,\n\
            \t.param .u64 _Z3addPfS_i_param_1,\n\t.param .u32 _Z3addPfS_i_param_2\n)\n{\n ret;\n}\n\
            .visible .entry fill(\n\t.param .align 8 .b8 fill_param_0[16]\n)\n{ ret; }\n\
            .visible .entry nothing()\n{ ret; }\n.entry bare\n{ ret; }\n\0";
        let counts = entry_param_counts(ptx.as_bytes());
        assert_eq!(counts.len(), 4, "{counts:?}");
        assert_eq!(counts["_Z3addPfS_i"], 3);
        assert_eq!(counts["fill"], 1);
        assert_eq!(counts["nothing"], 0);
        assert_eq!(counts["bare"], 0);
    }

    #[test]
    fn a_binary_image_says_nothing() {
        assert!(entry_param_counts(&[0x7f, b'E', b'L', b'F', 0xff, 0xfe]).is_empty());
    }
}
