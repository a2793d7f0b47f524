//! A vector in fixed pages, for the big dense arrays (block records, recency nodes, engine
//! blocks): it grows a page at a time, so it never holds more than one page of spare room.
//! A `Vec` doubles, and right after doubling half of it is spare: at 16.8M blocks that was
//! 12 of the 62 bytes an index entry cost.

use std::ops::{Index, IndexMut};

/// Elements per page (a power of two: indexing is a shift and a mask).
const PAGE: usize = 1 << 10;

/// Elements `0..len` in pages of [`PAGE`]; every page but the last is full.
#[derive(Debug, Clone)]
pub(crate) struct Pages<T> {
    pages: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Pages<T> {
    fn default() -> Self {
        Pages {
            pages: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Pages<T> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Appends `v`; returns its index.
    pub(crate) fn push(&mut self, v: T) -> usize {
        if self.len % PAGE == 0 {
            self.pages.push(Vec::with_capacity(PAGE));
        }
        self.pages.last_mut().expect("a page with room").push(v);
        self.len += 1;
        self.len - 1
    }

    /// Removes the last element.
    pub(crate) fn pop(&mut self) -> Option<T> {
        let page = self.pages.last_mut()?;
        let v = page.pop();
        if page.is_empty() {
            self.pages.pop();
        }
        self.len -= 1;
        v
    }

    /// Removes element `i`, moving the last one into its place.
    pub(crate) fn swap_remove(&mut self, i: usize) -> T {
        let last = self.pop().expect("index in bounds");
        if i == self.len {
            return last;
        }
        std::mem::replace(&mut self[i], last)
    }

    /// Heap bytes: the pages (each allocated whole) and the page list.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.pages.len() * PAGE * std::mem::size_of::<T>()
            + self.pages.capacity() * std::mem::size_of::<Vec<T>>()
    }
}

impl<T> Index<usize> for Pages<T> {
    type Output = T;

    #[inline]
    fn index(&self, i: usize) -> &T {
        &self.pages[i / PAGE][i % PAGE]
    }
}

impl<T> IndexMut<usize> for Pages<T> {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.pages[i / PAGE][i % PAGE]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_shrinks_a_page_at_a_time() {
        let mut p = Pages::default();
        assert_eq!(p.len(), 0);
        for i in 0..(2 * PAGE + 5) {
            assert_eq!(p.push(i), i);
        }
        assert_eq!((p.len(), p.pages.len()), (2 * PAGE + 5, 3));
        assert_eq!(p[PAGE + 7], PAGE + 7);
        p[3] = 99;
        assert_eq!(p.swap_remove(3), 99);
        assert_eq!(p[3], 2 * PAGE + 4, "the last moved in");
        assert_eq!(p.swap_remove(p.len() - 1), 2 * PAGE + 3);
        for _ in 0..3 {
            p.pop();
        }
        assert_eq!(
            (p.len(), p.pages.len()),
            (2 * PAGE, 2),
            "an empty page goes"
        );
        assert_eq!(p[2 * PAGE - 1], 2 * PAGE - 1);
        assert!(p.heap_bytes() >= 2 * PAGE * 8);
        while p.pop().is_some() {}
        assert!(p.len() == 0 && p.pages.is_empty());
    }
}
