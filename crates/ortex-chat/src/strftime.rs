//! The time a template sees through `strftime_now`.
//!
//! Hugging Face gives templates `strftime_now(format)`, which formats the machine's local time. Rendering
//! here reads no clock: the caller passes the time as a [`DateTime`] (a civil date and time, in whatever
//! zone the caller wants the model to see), and a template that asks for it without one fails with
//! [`ChatErrorCode::TimeMissing`](crate::ChatErrorCode::TimeMissing).

use std::fmt::{self, Write};

use crate::error::{ChatError, ChatErrorCode};

/// A civil date and time, as `strftime_now` formats it. No time zone: it is the wall-clock time the
/// caller wants the template to print.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DateTime {
    year: i32,
    month: u8,
    day: u8,
    hour: u8,
    minute: u8,
    second: u8,
}

impl DateTime {
    /// A date and time; fails with [`ChatErrorCode::InputInvalid`] for a day that does not exist or a time
    /// outside 00:00:00-23:59:59.
    pub fn new(year: i32, month: u8, day: u8, hour: u8, minute: u8, second: u8) -> Result<DateTime, ChatError> {
        let valid_date = (1..=12).contains(&month) && day >= 1 && day <= days_in_month(year, month);
        if !valid_date || hour > 23 || minute > 59 || second > 59 {
            return Err(ChatError::new(
                ChatErrorCode::InputInvalid,
                format!("{year:04}-{month:02}-{day:02} {hour:02}:{minute:02}:{second:02} is not a valid date and time"),
            ));
        }
        Ok(DateTime { year, month, day, hour, minute, second })
    }

    /// The UTC date and time `seconds` after 1970-01-01T00:00:00Z (negative: before).
    pub fn from_unix_seconds(seconds: i64) -> DateTime {
        let days = seconds.div_euclid(86_400);
        let second_of_day = seconds.rem_euclid(86_400);
        let (year, month, day) = civil_from_days(days);
        // The casts cannot truncate: hour < 24, minute < 60, second < 60 by the arithmetic.
        DateTime {
            year,
            month,
            day,
            hour: (second_of_day / 3600) as u8,
            minute: (second_of_day / 60 % 60) as u8,
            second: (second_of_day % 60) as u8,
        }
    }

    pub fn year(&self) -> i32 {
        self.year
    }
    pub fn month(&self) -> u8 {
        self.month
    }
    pub fn day(&self) -> u8 {
        self.day
    }
    pub fn hour(&self) -> u8 {
        self.hour
    }
    pub fn minute(&self) -> u8 {
        self.minute
    }
    pub fn second(&self) -> u8 {
        self.second
    }

    /// Monday = 0 ... Sunday = 6, as Python's `weekday()`.
    fn weekday_from_monday(&self) -> u8 {
        // 1970-01-01 was a Thursday (3 counting from Monday).
        (days_from_civil(self.year, self.month, self.day) + 3).rem_euclid(7) as u8
    }

    fn day_of_year(&self) -> u16 {
        (days_from_civil(self.year, self.month, self.day) - days_from_civil(self.year, 1, 1) + 1) as u16
    }

    /// Formats like C's `strftime` in the C locale, as Python's `datetime.strftime` on Linux: the
    /// directives `%a %A %b %B %d %e %H %I %j %m %M %p %S %y %Y %F %T %D %%`, and glibc's `-` flag
    /// (`%-d`: no padding) on the numeric ones. Any other directive is an error rather than a guess.
    pub fn strftime(&self, format: &str) -> Result<String, ChatError> {
        let mut out = String::with_capacity(format.len() + 16);
        let mut chars = format.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let mut directive = chars.next();
            let unpadded = directive == Some('-');
            if unpadded {
                directive = chars.next();
            }
            let Some(directive) = directive else {
                return Err(unsupported(format, "a lone % at the end"));
            };
            self.write_directive(&mut out, directive, unpadded)
                .map_err(|_| unsupported(format, &format!("%{}{directive}", if unpadded { "-" } else { "" })))?;
        }
        Ok(out)
    }

    fn write_directive(&self, out: &mut String, directive: char, unpadded: bool) -> Result<(), fmt::Error> {
        let number = |out: &mut String, value: u32, width: usize| {
            if unpadded {
                write!(out, "{value}")
            } else {
                write!(out, "{value:0width$}")
            }
        };
        let hour12 = match self.hour % 12 {
            0 => 12,
            hour => hour,
        };
        match directive {
            'a' => out.push_str(&WEEKDAYS[usize::from(self.weekday_from_monday())][..3]),
            'A' => out.push_str(WEEKDAYS[usize::from(self.weekday_from_monday())]),
            'b' => out.push_str(&MONTHS[usize::from(self.month - 1)][..3]),
            'B' => out.push_str(MONTHS[usize::from(self.month - 1)]),
            'd' => number(out, u32::from(self.day), 2)?,
            'e' if unpadded => number(out, u32::from(self.day), 1)?,
            'e' => write!(out, "{:>2}", self.day)?,
            'H' => number(out, u32::from(self.hour), 2)?,
            'I' => number(out, u32::from(hour12), 2)?,
            'j' => number(out, u32::from(self.day_of_year()), 3)?,
            'm' => number(out, u32::from(self.month), 2)?,
            'M' => number(out, u32::from(self.minute), 2)?,
            'S' => number(out, u32::from(self.second), 2)?,
            'p' if !unpadded => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
            'y' => number(out, self.year.rem_euclid(100) as u32, 2)?,
            'Y' if !unpadded => write!(out, "{}", self.year)?,
            'F' if !unpadded => write!(out, "{}-{:02}-{:02}", self.year, self.month, self.day)?,
            'T' if !unpadded => write!(out, "{:02}:{:02}:{:02}", self.hour, self.minute, self.second)?,
            'D' if !unpadded => write!(out, "{:02}/{:02}/{:02}", self.month, self.day, self.year.rem_euclid(100))?,
            '%' if !unpadded => out.push('%'),
            _ => return Err(fmt::Error),
        }
        Ok(())
    }
}

const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

fn unsupported(format: &str, what: &str) -> ChatError {
    ChatError::new(
        ChatErrorCode::TemplateFailed,
        format!("strftime_now({format:?}): {what} is not a supported strftime directive"),
    )
}

fn is_leap_year(year: i32) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i32, month: u8) -> u8 {
    match month {
        2 if is_leap_year(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i32, month: u8, day: u8) -> i64 {
    let year = i64::from(year) - i64::from(month <= 2);
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month = i64::from(month);
    let day_of_year = (153 * (if month > 2 { month - 3 } else { month + 9 }) + 2) / 5 + i64::from(day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// The inverse of [`days_from_civil`].
fn civil_from_days(days: i64) -> (i32, u8, u8) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u8;
    let month = if month_index < 10 { month_index + 3 } else { month_index - 9 } as u8;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    // Years beyond i32 need unix times of more than 6e16 seconds; clamp rather than wrap.
    (year.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_seconds_map_to_civil_time() {
        assert_eq!(DateTime::from_unix_seconds(0), DateTime::new(1970, 1, 1, 0, 0, 0).unwrap());
        assert_eq!(DateTime::from_unix_seconds(1_741_356_309), DateTime::new(2025, 3, 7, 14, 5, 9).unwrap());
        assert_eq!(DateTime::from_unix_seconds(951_782_400), DateTime::new(2000, 2, 29, 0, 0, 0).unwrap());
        assert_eq!(DateTime::from_unix_seconds(-1), DateTime::new(1969, 12, 31, 23, 59, 59).unwrap());
    }

    #[test]
    fn formats_like_python_strftime() {
        let time = DateTime::new(2025, 3, 7, 14, 5, 9).unwrap();
        assert_eq!(time.strftime("%d %b %Y").unwrap(), "07 Mar 2025");
        assert_eq!(time.strftime("%A, %B %-d, %Y").unwrap(), "Friday, March 7, 2025");
        assert_eq!(time.strftime("%Y-%m-%d %H:%M:%S").unwrap(), "2025-03-07 14:05:09");
        assert_eq!(
            time.strftime("%I:%M %p, day %j, %e|%F %T %D 100%%").unwrap(),
            "02:05 PM, day 066,  7|2025-03-07 14:05:09 03/07/25 100%"
        );
        assert_eq!(DateTime::new(2024, 12, 31, 0, 0, 0).unwrap().strftime("%a %j %I %p").unwrap(), "Tue 366 12 AM");
    }

    #[test]
    fn unknown_directives_and_invalid_dates_fail() {
        let time = DateTime::new(2025, 3, 7, 14, 5, 9).unwrap();
        assert_eq!(time.strftime("%Q").unwrap_err().code, ChatErrorCode::TemplateFailed);
        assert_eq!(time.strftime("100%").unwrap_err().code, ChatErrorCode::TemplateFailed);
        assert_eq!(DateTime::new(2025, 2, 29, 0, 0, 0).unwrap_err().code, ChatErrorCode::InputInvalid);
        assert_eq!(DateTime::new(2025, 1, 1, 24, 0, 0).unwrap_err().code, ChatErrorCode::InputInvalid);
    }
}
