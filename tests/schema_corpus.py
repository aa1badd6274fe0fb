"""A hand-written corpus of JSON schemas shaped like what real APIs send to a structured-output
endpoint (response formats, tool-call arguments, webhook payloads, config files).

`SCHEMAS` is a list of (name, schema). Every schema is kept small enough that a 135M model
sampling at temperature 1 finishes a valid instance in well under ~250 tokens: free-text strings
carry a maxLength, arrays a maxItems, numbers bounds, recursive structures an optional / nullable
link so that the recursion can stop.

Coverage: nested objects, arrays with minItems / maxItems, enum (also with null), const, formats
(date, date-time, time, email, uuid, uri, ipv4), anchored string patterns, integer and number
bounds (inclusive and exclusive), optional properties, additionalProperties false, $ref / $defs
(and a root "#" self-reference), anyOf, oneOf with const-discriminated (disjoint) alternatives,
recursive structures (tree, comment thread, linked list, file system), nullable fields
(type [..., "null"]), top-level arrays / enums / strings.

Deliberately absent, because the default backend (xgrammar 0.2.9) accepts but does not enforce
them, so sampled outputs could violate the schema: uniqueItems, multipleOf, allOf, and a pattern
with an optional group whose body has a variable repetition, e.g. "^[a-z]{1,5}(:[A-Z]{1,10})?$"
(xgrammar lets the group's leading ":" be skipped; see tests/grammar/test_grammar_engine.py).
Numbers: minimum / maximum bound the value, but no backend bounds a number's fraction digits
(llguidance, the default for JSON schemas, lets them run on), so a number field counts as free length.
Kept on purpose although xgrammar does not bound their length (FREE_LENGTH_FORMATS): a few
email / uri format strings and date-time / time formats; every other e-mail / URL / timestamp
field uses a bounded pattern.

`describe(name)` gives the short instruction used as the prompt for a schema.
"""

from __future__ import annotations

# --- small shared pieces (plain dicts, never mutated) ------------------------------------------
NAME = {"type": "string", "minLength": 1, "maxLength": 40}
SHORT = {"type": "string", "minLength": 1, "maxLength": 24}
TEXT = {"type": "string", "maxLength": 120}
# Most e-mail / timestamp / URL fields use a bounded pattern (as many OpenAPI specs do); the
# `format` versions are used in a few schemas only: xgrammar (the default backend) bounds neither
# an email / uri string by its maxLength nor the fractional seconds of a date-time / time, and at
# temperature 1 a small model runs away inside them (see FREE_LENGTH_FORMATS).
EMAIL = {"type": "string", "pattern": "^[a-z0-9._-]{1,24}@[a-z0-9-]{1,20}\\.[a-z]{2,6}$"}
EMAIL_FORMAT = {"type": "string", "format": "email", "maxLength": 60}
TIMESTAMP = {
    "type": "string",
    "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]Z$",
}
UUID = {"type": "string", "format": "uuid"}
DATE = {"type": "string", "format": "date"}
DATETIME = {"type": "string", "format": "date-time"}
URI = {"type": "string", "format": "uri", "maxLength": 80}
URL = {"type": "string", "pattern": "^https?://[a-z0-9.-]{1,30}/[a-z0-9/_-]{0,30}$"}
CURRENCY = {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]}
MONEY = {"type": "number", "minimum": 0, "maximum": 100000}

ADDRESS = {
    "type": "object",
    "properties": {
        "street": NAME,
        "city": SHORT,
        "postal_code": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
        "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
    },
    "required": ["street", "city", "postal_code", "country"],
    "additionalProperties": False,
}


SCHEMAS: list[tuple[str, dict]] = [
    # ---------------------------------------------------------------- people, accounts
    (
        "user_profile",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 1000000},
                "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
                "email": EMAIL_FORMAT,
                "full_name": NAME,
                "age": {"type": "integer", "minimum": 13, "maximum": 120},
                "created_at": DATETIME,
                "is_verified": {"type": "boolean"},
            },
            "required": ["id", "username", "email", "created_at", "is_verified"],
            "additionalProperties": False,
        },
    ),
    (
        "contact_card",
        {
            "type": "object",
            "properties": {
                "name": {
                    "type": "object",
                    "properties": {
                        "given": SHORT,
                        "family": SHORT,
                        "middle": {"type": ["string", "null"], "maxLength": 20},
                    },
                    "required": ["given", "family"],
                    "additionalProperties": False,
                },
                "phones": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {
                            "kind": {"type": "string", "enum": ["mobile", "home", "work"]},
                            "number": {"type": "string", "pattern": "^\\+[1-9][0-9]{7,13}$"},
                        },
                        "required": ["kind", "number"],
                        "additionalProperties": False,
                    },
                },
                "emails": {"type": "array", "items": EMAIL, "minItems": 1, "maxItems": 2},
                "birthday": {"type": ["string", "null"], "format": "date"},
                "website": {"type": ["string", "null"], "format": "uri", "maxLength": 60},
            },
            "required": ["name", "emails"],
            "additionalProperties": False,
        },
    ),
    (
        "person_with_addresses",
        {
            "$defs": {"address": ADDRESS},
            "type": "object",
            "properties": {
                "name": NAME,
                "home_address": {"$ref": "#/$defs/address"},
                "work_address": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
            },
            "required": ["name", "home_address", "work_address"],
            "additionalProperties": False,
        },
    ),
    (
        "user_preferences",
        {
            "type": "object",
            "properties": {
                "theme": {"type": "string", "enum": ["light", "dark", "system"]},
                "language": {"type": "string", "pattern": "^[a-z]{2}(-[A-Z]{2})?$"},
                "timezone": {"type": "string", "enum": ["UTC", "Europe/Paris", "America/New_York", "Asia/Tokyo"]},
                "notifications": {
                    "type": "object",
                    "properties": {
                        "email": {"type": "boolean"},
                        "sms": {"type": "boolean"},
                        "push": {"type": "boolean"},
                    },
                    "required": ["email", "sms", "push"],
                    "additionalProperties": False,
                },
                "items_per_page": {"type": "integer", "enum": [10, 25, 50, 100]},
            },
            "required": ["theme", "language", "notifications"],
            "additionalProperties": False,
        },
    ),
    (
        "oauth_token_response",
        {
            "type": "object",
            "properties": {
                "access_token": {"type": "string", "pattern": "^[A-Za-z0-9_-]{20,40}$"},
                "token_type": {"const": "Bearer"},
                "expires_in": {"type": "integer", "minimum": 60, "maximum": 86400},
                "refresh_token": {"type": "string", "pattern": "^[A-Za-z0-9_-]{20,40}$"},
                "scope": {"type": "string", "pattern": "^[a-z:]{1,20}( [a-z:]{1,20}){0,3}$"},
            },
            "required": ["access_token", "token_type", "expires_in"],
            "additionalProperties": False,
        },
    ),
    # ---------------------------------------------------------------- commerce
    (
        "order_with_line_items",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                "customer_id": UUID,
                "status": {"type": "string", "enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
                            "unit_price": MONEY,
                        },
                        "required": ["sku", "quantity", "unit_price"],
                        "additionalProperties": False,
                    },
                },
                "total": MONEY,
                "currency": {"const": "USD"},
                "placed_at": TIMESTAMP,
            },
            "required": ["order_id", "customer_id", "status", "items", "total", "currency", "placed_at"],
            "additionalProperties": False,
        },
    ),
    (
        "product_catalog_entry",
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z0-9]{4,12}$"},
                "name": NAME,
                "description": {"type": "string", "maxLength": 100},
                "price": {
                    "type": "object",
                    "properties": {"amount": MONEY, "currency": CURRENCY},
                    "required": ["amount", "currency"],
                    "additionalProperties": False,
                },
                "categories": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "string",
                        "enum": ["electronics", "books", "clothing", "home", "toys", "sports", "grocery"],
                    },
                },
                "in_stock": {"type": "boolean"},
                "dimensions_cm": {
                    "type": "object",
                    "properties": {
                        "width": {"type": "number", "minimum": 0, "maximum": 500},
                        "height": {"type": "number", "minimum": 0, "maximum": 500},
                        "depth": {"type": "number", "minimum": 0, "maximum": 500},
                    },
                    "required": ["width", "height", "depth"],
                    "additionalProperties": False,
                },
            },
            "required": ["sku", "name", "price", "categories", "in_stock"],
            "additionalProperties": False,
        },
    ),
    (
        "invoice",
        {
            "$defs": {
                "party": {
                    "type": "object",
                    "properties": {"name": NAME, "email": EMAIL, "address": {"$ref": "#/$defs/address"}},
                    "required": ["name", "address"],
                    "additionalProperties": False,
                },
                "address": ADDRESS,
            },
            "type": "object",
            "properties": {
                "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4}-[0-9]{4}$"},
                "issue_date": DATE,
                "due_date": DATE,
                "bill_to": {"$ref": "#/$defs/party"},
                "lines": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "description": {"type": "string", "maxLength": 40},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                            "unit_price": MONEY,
                            "tax_rate": {"enum": [0, 0.05, 0.1, 0.2]},
                        },
                        "required": ["description", "quantity", "unit_price", "tax_rate"],
                        "additionalProperties": False,
                    },
                },
                "total": MONEY,
                "paid": {"type": "boolean"},
            },
            "required": ["invoice_number", "issue_date", "due_date", "bill_to", "lines", "total", "paid"],
            "additionalProperties": False,
        },
    ),
    (
        "payment_method",
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {
                        "type": {"const": "card"},
                        "brand": {"type": "string", "enum": ["visa", "mastercard", "amex"]},
                        "last4": {"type": "string", "pattern": "^[0-9]{4}$"},
                        "exp_month": {"type": "integer", "minimum": 1, "maximum": 12},
                        "exp_year": {"type": "integer", "minimum": 2024, "maximum": 2040},
                    },
                    "required": ["type", "brand", "last4", "exp_month", "exp_year"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "type": {"const": "bank_account"},
                        "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,20}$"},
                        "bank_name": SHORT,
                    },
                    "required": ["type", "iban"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "type": {"const": "wallet"},
                        "provider": {"type": "string", "enum": ["apple_pay", "google_pay", "paypal"]},
                    },
                    "required": ["type", "provider"],
                    "additionalProperties": False,
                },
            ],
        },
    ),
    (
        "bank_transaction",
        {
            "type": "object",
            "properties": {
                "id": UUID,
                "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000000},
                "currency": CURRENCY,
                "direction": {"type": "string", "enum": ["credit", "debit"]},
                "counterparty": {
                    "type": "object",
                    "properties": {
                        "name": NAME,
                        "iban": {"type": ["string", "null"], "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,20}$"},
                    },
                    "required": ["name", "iban"],
                    "additionalProperties": False,
                },
                "booked_on": DATE,
                "category": {"enum": ["groceries", "rent", "salary", "transport", "utilities", None]},
            },
            "required": ["id", "amount", "currency", "direction", "counterparty", "booked_on", "category"],
            "additionalProperties": False,
        },
    ),
    (
        "stock_quote",
        {
            "type": "object",
            "properties": {
                "symbol": {"type": "string", "pattern": "^[A-Z]{1,5}$"},
                "exchange": {"type": "string", "enum": ["NYSE", "NASDAQ", "LSE", "TSE"]},
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 100000},
                "change_pct": {"type": "number", "minimum": -100, "maximum": 100},
                "volume": {"type": "integer", "minimum": 0, "maximum": 10000000000},
                "as_of": TIMESTAMP,
            },
            "required": ["symbol", "exchange", "price", "change_pct", "volume", "as_of"],
            "additionalProperties": False,
        },
    ),
    (
        "shopping_cart",
        {
            "type": "object",
            "properties": {
                "cart_id": UUID,
                "items": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "product_id": {"type": "integer", "minimum": 1, "maximum": 99999},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["product_id", "qty"],
                        "additionalProperties": False,
                    },
                },
                "coupon": {"type": ["string", "null"], "pattern": "^[A-Z0-9]{4,10}$"},
            },
            "required": ["cart_id", "items", "coupon"],
            "additionalProperties": False,
        },
    ),
    # ---------------------------------------------------------------- weather, time, places
    (
        "weather_report",
        {
            "type": "object",
            "properties": {
                "location": {
                    "type": "object",
                    "properties": {
                        "city": SHORT,
                        "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
                        "lat": {"type": "number", "minimum": -90, "maximum": 90},
                        "lon": {"type": "number", "minimum": -180, "maximum": 180},
                    },
                    "required": ["city", "country", "lat", "lon"],
                    "additionalProperties": False,
                },
                "date": DATE,
                "temperature_c": {"type": "number", "minimum": -80, "maximum": 60},
                "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow", "storm", "fog"]},
                "humidity_pct": {"type": "integer", "minimum": 0, "maximum": 100},
                "wind": {
                    "type": "object",
                    "properties": {
                        "speed_kmh": {"type": "number", "minimum": 0, "maximum": 300},
                        "direction": {"type": "string", "enum": ["N", "NE", "E", "SE", "S", "SW", "W", "NW"]},
                    },
                    "required": ["speed_kmh", "direction"],
                    "additionalProperties": False,
                },
            },
            "required": ["location", "date", "temperature_c", "conditions", "humidity_pct"],
            "additionalProperties": False,
        },
    ),
    (
        "calendar_event",
        {
            "type": "object",
            "properties": {
                "title": NAME,
                "start": DATETIME,
                "end": DATETIME,
                "all_day": {"type": "boolean"},
                "location": {"type": ["string", "null"], "maxLength": 40},
                "attendees": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "email": EMAIL,
                            "response": {"type": "string", "enum": ["accepted", "declined", "tentative", "none"]},
                        },
                        "required": ["email", "response"],
                        "additionalProperties": False,
                    },
                },
                "recurrence": {"type": "string", "enum": ["none", "daily", "weekly", "monthly"]},
                "reminders_minutes": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {"type": "integer", "minimum": 0, "maximum": 10080},
                },
            },
            "required": ["title", "start", "end", "all_day", "attendees"],
            "additionalProperties": False,
        },
    ),
    (
        "restaurant_reservation",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "party_size": {"type": "integer", "minimum": 1, "maximum": 12},
                "date": DATE,
                "time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
                "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,14}$"},
                "table_preference": {"enum": ["indoor", "outdoor", "bar", None]},
                "special_requests": {"type": ["string", "null"], "maxLength": 80},
            },
            "required": ["name", "party_size", "date", "time", "phone"],
            "additionalProperties": False,
        },
    ),
    (
        "flight_booking",
        {
            "type": "object",
            "properties": {
                "booking_ref": {"type": "string", "pattern": "^[A-Z0-9]{6}$"},
                "class": {"type": "string", "enum": ["economy", "premium_economy", "business", "first"]},
                "passengers": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {
                            "first_name": SHORT,
                            "last_name": SHORT,
                            "date_of_birth": DATE,
                            "seat": {"type": ["string", "null"], "pattern": "^[0-9]{1,2}[A-F]$"},
                        },
                        "required": ["first_name", "last_name", "date_of_birth", "seat"],
                        "additionalProperties": False,
                    },
                },
                "segments": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {
                            "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                            "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                            "flight_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,4}$"},
                            "departure": TIMESTAMP,
                        },
                        "required": ["from", "to", "flight_number", "departure"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["booking_ref", "class", "passengers", "segments"],
            "additionalProperties": False,
        },
    ),
    (
        "geojson_point_feature",
        {
            "type": "object",
            "properties": {
                "type": {"const": "Feature"},
                "geometry": {
                    "type": "object",
                    "properties": {
                        "type": {"const": "Point"},
                        "coordinates": {
                            "type": "array",
                            "minItems": 2,
                            "maxItems": 2,
                            "items": {"type": "number", "minimum": -180, "maximum": 180},
                        },
                    },
                    "required": ["type", "coordinates"],
                    "additionalProperties": False,
                },
                "properties": {
                    "type": "object",
                    "properties": {
                        "name": SHORT,
                        "elevation_m": {"type": ["integer", "null"], "minimum": -500, "maximum": 9000},
                    },
                    "required": ["name"],
                    "additionalProperties": False,
                },
            },
            "required": ["type", "geometry", "properties"],
            "additionalProperties": False,
        },
    ),
    (
        "shipping_address_validation",
        {
            "type": "object",
            "properties": {
                "input": ADDRESS,
                "valid": {"type": "boolean"},
                "issues": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {
                        "type": "string",
                        "enum": ["missing_unit", "unknown_street", "postal_mismatch", "undeliverable"],
                    },
                },
                "suggestion": {"anyOf": [ADDRESS, {"type": "null"}]},
            },
            "required": ["input", "valid", "issues", "suggestion"],
            "additionalProperties": False,
        },
    ),
    # ---------------------------------------------------------------- developer tools
    (
        "github_issue",
        {
            "$defs": {
                "user": {
                    "type": "object",
                    "properties": {
                        "login": {"type": "string", "pattern": "^[a-zA-Z0-9-]{1,20}$"},
                        "id": {"type": "integer", "minimum": 1, "maximum": 99999999},
                    },
                    "required": ["login", "id"],
                    "additionalProperties": False,
                },
            },
            "type": "object",
            "properties": {
                "number": {"type": "integer", "minimum": 1, "maximum": 100000},
                "title": {"type": "string", "minLength": 1, "maxLength": 60},
                "state": {"type": "string", "enum": ["open", "closed"]},
                "user": {"$ref": "#/$defs/user"},
                "assignee": {"anyOf": [{"$ref": "#/$defs/user"}, {"type": "null"}]},
                "labels": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {"name": SHORT, "color": {"type": "string", "pattern": "^[0-9a-f]{6}$"}},
                        "required": ["name", "color"],
                        "additionalProperties": False,
                    },
                },
                "body": {"type": ["string", "null"], "maxLength": 100},
                "created_at": DATETIME,
                "closed_at": {"type": ["string", "null"], "format": "date-time"},
            },
            "required": ["number", "title", "state", "user", "assignee", "labels", "created_at", "closed_at"],
            "additionalProperties": False,
        },
    ),
    (
        "log_entry",
        {
            "type": "object",
            "properties": {
                "timestamp": DATETIME,
                "level": {"type": "string", "enum": ["DEBUG", "INFO", "WARN", "ERROR", "FATAL"]},
                "service": {"type": "string", "pattern": "^[a-z][a-z0-9-]{1,30}$"},
                "message": {"type": "string", "maxLength": 100},
                "trace_id": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
                "context": {
                    "type": "object",
                    "properties": {
                        "user_id": {"type": ["integer", "null"], "minimum": 1, "maximum": 1000000},
                        "request_id": UUID,
                        "latency_ms": {"type": "number", "minimum": 0, "maximum": 60000},
                    },
                    "required": ["request_id"],
                    "additionalProperties": False,
                },
            },
            "required": ["timestamp", "level", "service", "message"],
            "additionalProperties": False,
        },
    ),
    (
        "http_request",
        {
            "type": "object",
            "properties": {
                "method": {"type": "string", "enum": ["GET", "POST", "PUT", "PATCH", "DELETE"]},
                "url": URI,
                "headers": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9-]{0,30}$"},
                            "value": {"type": "string", "maxLength": 60},
                        },
                        "required": ["name", "value"],
                        "additionalProperties": False,
                    },
                },
                "body": {"type": ["string", "null"], "maxLength": 100},
                "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 300},
            },
            "required": ["method", "url", "headers", "body"],
            "additionalProperties": False,
        },
    ),
    (
        "api_error_response",
        {
            "type": "object",
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        "status": {"type": "integer", "minimum": 400, "maximum": 599},
                        "code": {"type": "string", "pattern": "^[A-Z][A-Z_]{2,30}$"},
                        "message": {"type": "string", "maxLength": 100},
                        "details": {
                            "type": "array",
                            "maxItems": 2,
                            "items": {
                                "type": "object",
                                "properties": {"field": SHORT, "issue": {"type": "string", "maxLength": 60}},
                                "required": ["field", "issue"],
                                "additionalProperties": False,
                            },
                        },
                    },
                    "required": ["status", "code", "message"],
                    "additionalProperties": False,
                },
                "request_id": UUID,
            },
            "required": ["error", "request_id"],
            "additionalProperties": False,
        },
    ),
    (
        "paginated_list_response",
        {
            "type": "object",
            "properties": {
                "data": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {"id": UUID, "name": SHORT, "created": DATE},
                        "required": ["id", "name", "created"],
                        "additionalProperties": False,
                    },
                },
                "page": {"type": "integer", "minimum": 1, "maximum": 1000},
                "page_size": {"type": "integer", "enum": [10, 20, 50, 100]},
                "total": {"type": "integer", "minimum": 0, "maximum": 1000000},
                "next_cursor": {"type": ["string", "null"], "pattern": "^[A-Za-z0-9=]{8,24}$"},
            },
            "required": ["data", "page", "page_size", "total", "next_cursor"],
            "additionalProperties": False,
        },
    ),
    (
        "feature_flag",
        {
            "type": "object",
            "properties": {
                "key": {"type": "string", "pattern": "^[a-z][a-z0-9_.]{2,30}$"},
                "enabled": {"type": "boolean"},
                "rollout_percentage": {"type": "integer", "minimum": 0, "maximum": 100},
                "variants": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "pattern": "^[a-z_]{1,16}$"},
                            "weight": {"type": "integer", "minimum": 0, "maximum": 100},
                        },
                        "required": ["name", "weight"],
                        "additionalProperties": False,
                    },
                },
                "owner": EMAIL,
            },
            "required": ["key", "enabled", "rollout_percentage", "owner"],
            "additionalProperties": False,
        },
    ),
    (
        "container_spec",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$"},
                "image": {"type": "string", "pattern": "^[a-z0-9./-]{1,40}:[A-Za-z0-9._-]{1,20}$"},
                "ports": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {
                            "containerPort": {"type": "integer", "minimum": 1, "maximum": 65535},
                            "protocol": {"type": "string", "enum": ["TCP", "UDP"]},
                        },
                        "required": ["containerPort", "protocol"],
                        "additionalProperties": False,
                    },
                },
                "env": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "pattern": "^[A-Z_][A-Z0-9_]{0,30}$"},
                            "value": {"type": "string", "maxLength": 40},
                        },
                        "required": ["name", "value"],
                        "additionalProperties": False,
                    },
                },
                "resources": {
                    "type": "object",
                    "properties": {
                        "cpu": {"type": "string", "pattern": "^[0-9]{1,5}m$"},
                        "memory": {"type": "string", "pattern": "^[0-9]{1,5}Mi$"},
                    },
                    "required": ["cpu", "memory"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "image", "resources"],
            "additionalProperties": False,
        },
    ),
    (
        "deployment_config",
        {
            "type": "object",
            "properties": {
                "version": {"const": 2},
                "services": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{1,20}$"},
                            "replicas": {"type": "integer", "minimum": 1, "maximum": 10},
                            "healthcheck_url": URL,
                        },
                        "required": ["name", "replicas"],
                        "additionalProperties": False,
                    },
                },
                "logging": {
                    "type": "object",
                    "properties": {
                        "level": {"type": "string", "enum": ["debug", "info", "warning", "error"]},
                        "format": {"type": "string", "enum": ["json", "text"]},
                    },
                    "required": ["level", "format"],
                    "additionalProperties": False,
                },
            },
            "required": ["version", "services", "logging"],
            "additionalProperties": False,
        },
    ),
    (
        "json_patch",
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {
                            "op": {"const": "add"},
                            "path": {"type": "string", "pattern": "^(/[a-z0-9_]{1,12}){1,3}$"},
                            "value": {
                                "type": ["string", "integer", "boolean", "null"],
                                "maxLength": 30,
                                "minimum": -1000,
                                "maximum": 1000,
                            },
                        },
                        "required": ["op", "path", "value"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {
                            "op": {"const": "remove"},
                            "path": {"type": "string", "pattern": "^(/[a-z0-9_]{1,12}){1,3}$"},
                        },
                        "required": ["op", "path"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {
                            "op": {"const": "move"},
                            "from": {"type": "string", "pattern": "^(/[a-z0-9_]{1,12}){1,3}$"},
                            "path": {"type": "string", "pattern": "^(/[a-z0-9_]{1,12}){1,3}$"},
                        },
                        "required": ["op", "from", "path"],
                        "additionalProperties": False,
                    },
                ]
            },
        },
    ),
    (
        "network_device",
        {
            "type": "object",
            "properties": {
                "hostname": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,20}$"},
                "ip_address": {"type": "string", "format": "ipv4"},
                "mac_address": {"type": "string", "pattern": "^([0-9a-f]{2}:){5}[0-9a-f]{2}$"},
                "vlan": {"type": "integer", "minimum": 1, "maximum": 4094},
                "status": {"type": "string", "enum": ["up", "down", "maintenance"]},
            },
            "required": ["hostname", "ip_address", "mac_address", "status"],
            "additionalProperties": False,
        },
    ),
    # ---------------------------------------------------------------- tool-call arguments
    (
        "tool_call_get_weather",
        {
            "type": "object",
            "properties": {
                "location": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 40,
                    "description": "City and country, e.g. Paris, France",
                },
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "unit"],
            "additionalProperties": False,
        },
    ),
    (
        "tool_call_send_email",
        {
            "type": "object",
            "properties": {
                "to": {"type": "array", "items": EMAIL_FORMAT, "minItems": 1, "maxItems": 2},
                "cc": {"type": "array", "items": EMAIL, "maxItems": 2},
                "subject": {"type": "string", "minLength": 1, "maxLength": 60},
                "body": {"type": "string", "maxLength": 150},
                "priority": {"type": "string", "enum": ["low", "normal", "high"]},
            },
            "required": ["to", "subject", "body"],
            "additionalProperties": False,
        },
    ),
    (
        "tool_call_create_event",
        {
            "type": "object",
            "properties": {
                "summary": NAME,
                "start_time": DATETIME,
                "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
                "attendee_emails": {"type": "array", "items": EMAIL, "maxItems": 3},
                "video_call": {"type": "boolean"},
            },
            "required": ["summary", "start_time", "duration_minutes"],
            "additionalProperties": False,
        },
    ),
    (
        "tool_call_sql_query",
        {
            "type": "object",
            "properties": {
                "table": {"type": "string", "enum": ["users", "orders", "products", "events"]},
                "columns": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": {"type": "string", "pattern": "^[a-z_]{1,20}$"},
                },
                "where": {"type": ["string", "null"], "maxLength": 80},
                "order_by": {"type": "string", "pattern": "^[a-z_]{1,20} (ASC|DESC)$"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 1000},
            },
            "required": ["table", "columns", "where", "limit"],
            "additionalProperties": False,
        },
    ),
    (
        "tool_call_web_search",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1, "maxLength": 60},
                "num_results": {"type": "integer", "minimum": 1, "maximum": 10},
                "site": {"type": ["string", "null"], "pattern": "^[a-z0-9.-]{3,40}$"},
                "freshness": {"type": "string", "enum": ["day", "week", "month", "any"]},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    ),
    (
        "search_query_filters",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 50},
                "filters": {
                    "type": "object",
                    "properties": {
                        "price_min": {"type": "number", "minimum": 0, "maximum": 10000},
                        "price_max": {"type": "number", "minimum": 0, "maximum": 10000},
                        "brands": {
                            "type": "array",
                            "maxItems": 3,
                            "items": {"type": "string", "enum": ["acme", "globex", "initech", "umbrella"]},
                        },
                        "in_stock": {"type": "boolean"},
                        "rating_min": {"type": "number", "minimum": 0, "maximum": 5},
                    },
                    "additionalProperties": False,
                },
                "sort": {"type": "string", "enum": ["relevance", "price_asc", "price_desc", "newest"]},
                "page": {"type": "integer", "minimum": 1, "maximum": 100},
                "page_size": {"type": "integer", "enum": [10, 20, 50]},
            },
            "required": ["query", "filters", "sort"],
            "additionalProperties": False,
        },
    ),
    (
        "translation_request",
        {
            "type": "object",
            "properties": {
                "source_lang": {"type": "string", "enum": ["en", "fr", "de", "es", "ja", "zh"]},
                "target_lang": {"type": "string", "enum": ["en", "fr", "de", "es", "ja", "zh"]},
                "text": {"type": "string", "minLength": 1, "maxLength": 100},
                "formality": {"type": "string", "enum": ["formal", "informal", "default"]},
            },
            "required": ["source_lang", "target_lang", "text"],
            "additionalProperties": False,
        },
    ),
    (
        "chat_message_with_tool_calls",
        {
            "type": "object",
            "properties": {
                "role": {"type": "string", "enum": ["assistant"]},
                "content": {"type": ["string", "null"], "maxLength": 100},
                "tool_calls": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "string", "pattern": "^call_[A-Za-z0-9]{8}$"},
                            "type": {"const": "function"},
                            "function": {
                                "type": "object",
                                "properties": {
                                    "name": {"type": "string", "pattern": "^[a-z_]{1,24}$"},
                                    "arguments": {"type": "string", "maxLength": 80},
                                },
                                "required": ["name", "arguments"],
                                "additionalProperties": False,
                            },
                        },
                        "required": ["id", "type", "function"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["role", "content"],
            "additionalProperties": False,
        },
    ),
    # ---------------------------------------------------------------- NLP-style outputs
    (
        "sentiment_classification",
        {
            "type": "object",
            "properties": {
                "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                "keywords": {"type": "array", "maxItems": 3, "items": SHORT},
            },
            "required": ["label", "confidence"],
            "additionalProperties": False,
        },
    ),
    (
        "named_entities",
        {
            "type": "object",
            "properties": {
                "entities": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "text": SHORT,
                            "type": {"type": "string", "enum": ["PERSON", "ORG", "LOC", "DATE"]},
                            "start": {"type": "integer", "minimum": 0, "maximum": 1000},
                            "end": {"type": "integer", "minimum": 0, "maximum": 1000},
                        },
                        "required": ["text", "type", "start", "end"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["entities"],
            "additionalProperties": False,
        },
    ),
    (
        "math_answer",
        {
            "type": "object",
            "properties": {
                "reasoning": {"type": "string", "maxLength": 120},
                "answer": {"type": "number", "minimum": -1000000, "maximum": 1000000},
                "units": {"type": ["string", "null"], "maxLength": 10},
            },
            "required": ["reasoning", "answer", "units"],
            "additionalProperties": False,
        },
    ),
    (
        "keyword_list",
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 5,
            "items": {"type": "string", "pattern": "^[a-z]{2,15}$"},
        },
    ),
    ("yes_no_maybe", {"type": "string", "enum": ["yes", "no", "maybe"]}),
    (
        "movie_review",
        {
            "type": "object",
            "properties": {
                "movie_title": NAME,
                "year": {"type": "integer", "minimum": 1888, "maximum": 2030},
                "rating": {"type": "number", "minimum": 0, "maximum": 10},
                "reviewer": SHORT,
                "contains_spoilers": {"type": "boolean"},
                "review": {"type": "string", "maxLength": 120},
            },
            "required": ["movie_title", "year", "rating", "review"],
            "additionalProperties": False,
        },
    ),
    # ---------------------------------------------------------------- misc domains
    (
        "blog_post",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 1, "maxLength": 60},
                "slug": {"type": "string", "pattern": "^[a-z0-9]{1,12}(-[a-z0-9]{1,12}){0,5}$"},
                "author": {
                    "type": "object",
                    "properties": {"name": NAME, "email": EMAIL},
                    "required": ["name"],
                    "additionalProperties": False,
                },
                "status": {"type": "string", "enum": ["draft", "published", "archived"]},
                "published_at": {"type": ["string", "null"], "pattern": TIMESTAMP["pattern"]},
                "tags": {"type": "array", "maxItems": 4, "items": {"type": "string", "pattern": "^[a-z-]{2,15}$"}},
                "word_count": {"type": "integer", "minimum": 0, "maximum": 20000},
            },
            "required": ["title", "slug", "author", "status", "published_at"],
            "additionalProperties": False,
        },
    ),
    (
        "recipe",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "prep_time_minutes": {"type": "integer", "minimum": 1, "maximum": 600},
                "vegetarian": {"type": "boolean"},
                "ingredients": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": {
                        "type": "object",
                        "properties": {
                            "item": SHORT,
                            "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                            "unit": {"type": "string", "enum": ["g", "kg", "ml", "l", "tsp", "tbsp", "cup", "piece"]},
                        },
                        "required": ["item", "amount", "unit"],
                        "additionalProperties": False,
                    },
                },
                "steps": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {"type": "string", "minLength": 1, "maxLength": 50},
                },
            },
            "required": ["name", "servings", "ingredients", "steps"],
            "additionalProperties": False,
        },
    ),
    (
        "job_posting",
        {
            "type": "object",
            "properties": {
                "title": NAME,
                "company": SHORT,
                "location": {
                    "type": "object",
                    "properties": {"city": SHORT, "remote": {"type": "boolean"}},
                    "required": ["city", "remote"],
                    "additionalProperties": False,
                },
                "employment_type": {"type": "string", "enum": ["full_time", "part_time", "contract", "internship"]},
                "salary_range": {
                    "type": "object",
                    "properties": {
                        "min": {"type": "integer", "minimum": 0, "maximum": 1000000},
                        "max": {"type": "integer", "minimum": 0, "maximum": 1000000},
                        "currency": CURRENCY,
                    },
                    "required": ["min", "max", "currency"],
                    "additionalProperties": False,
                },
                "skills": {"type": "array", "maxItems": 4, "items": SHORT},
                "posted": DATE,
            },
            "required": ["title", "company", "location", "employment_type", "posted"],
            "additionalProperties": False,
        },
    ),
    (
        "medication_prescription",
        {
            "type": "object",
            "properties": {
                "patient_id": {"type": "string", "pattern": "^P[0-9]{6}$"},
                "drug": {
                    "type": "object",
                    "properties": {
                        "name": SHORT,
                        "strength_mg": {"type": "number", "exclusiveMinimum": 0, "maximum": 5000},
                        "form": {"type": "string", "enum": ["tablet", "capsule", "liquid", "injection"]},
                    },
                    "required": ["name", "strength_mg", "form"],
                    "additionalProperties": False,
                },
                "dosage": {
                    "type": "object",
                    "properties": {
                        "amount": {"type": "integer", "minimum": 1, "maximum": 10},
                        "frequency": {
                            "type": "string",
                            "enum": ["once_daily", "twice_daily", "every_8_hours", "as_needed"],
                        },
                    },
                    "required": ["amount", "frequency"],
                    "additionalProperties": False,
                },
                "start_date": DATE,
                "end_date": DATE,
                "refills": {"type": "integer", "minimum": 0, "maximum": 12},
                "prescriber_npi": {"type": "string", "pattern": "^[0-9]{10}$"},
            },
            "required": ["patient_id", "drug", "dosage", "start_date", "refills", "prescriber_npi"],
            "additionalProperties": False,
        },
    ),
    (
        "survey_response",
        {
            "type": "object",
            "properties": {
                "respondent_id": UUID,
                "submitted_at": TIMESTAMP,
                "answers": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "oneOf": [
                            {
                                "type": "object",
                                "properties": {
                                    "question_id": {"type": "integer", "minimum": 1, "maximum": 50},
                                    "kind": {"const": "rating"},
                                    "value": {"type": "integer", "minimum": 1, "maximum": 5},
                                },
                                "required": ["question_id", "kind", "value"],
                                "additionalProperties": False,
                            },
                            {
                                "type": "object",
                                "properties": {
                                    "question_id": {"type": "integer", "minimum": 1, "maximum": 50},
                                    "kind": {"const": "text"},
                                    "value": {"type": "string", "maxLength": 60},
                                },
                                "required": ["question_id", "kind", "value"],
                                "additionalProperties": False,
                            },
                            {
                                "type": "object",
                                "properties": {
                                    "question_id": {"type": "integer", "minimum": 1, "maximum": 50},
                                    "kind": {"const": "choice"},
                                    "value": {"type": "string", "enum": ["a", "b", "c", "d"]},
                                },
                                "required": ["question_id", "kind", "value"],
                                "additionalProperties": False,
                            },
                        ]
                    },
                },
            },
            "required": ["respondent_id", "submitted_at", "answers"],
            "additionalProperties": False,
        },
    ),
    (
        "vehicle_registration",
        {
            "$defs": {
                "owner": {
                    "type": "object",
                    "properties": {"name": NAME, "license_number": {"type": "string", "pattern": "^[A-Z][0-9]{7}$"}},
                    "required": ["name", "license_number"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {
                "vin": {"type": "string", "pattern": "^[A-HJ-NPR-Z0-9]{17}$"},
                "make": SHORT,
                "model": SHORT,
                "year": {"type": "integer", "minimum": 1950, "maximum": 2026},
                "fuel": {"type": "string", "enum": ["petrol", "diesel", "electric", "hybrid"]},
                "mileage_km": {"type": "integer", "minimum": 0, "maximum": 1000000},
                "owner": {"anyOf": [{"$ref": "#/$defs/owner"}, {"type": "null"}]},
            },
            "required": ["vin", "make", "model", "year", "fuel", "owner"],
            "additionalProperties": False,
        },
    ),
    (
        "library_book",
        {
            "type": "object",
            "properties": {
                "isbn": {"type": "string", "pattern": "^97[89]-[0-9]{10}$"},
                "title": NAME,
                "authors": {"type": "array", "minItems": 1, "maxItems": 3, "items": SHORT},
                "published_year": {"type": "integer", "minimum": 1450, "maximum": 2026},
                "genres": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {
                        "type": "string",
                        "enum": ["fiction", "mystery", "science", "history", "biography", "fantasy"],
                    },
                },
                "available": {"type": "boolean"},
                "due_back": {"type": ["string", "null"], "format": "date"},
            },
            "required": ["isbn", "title", "authors", "available", "due_back"],
            "additionalProperties": False,
        },
    ),
    (
        "sports_match",
        {
            "type": "object",
            "properties": {
                "home_team": SHORT,
                "away_team": SHORT,
                "kickoff": TIMESTAMP,
                "status": {"type": "string", "enum": ["scheduled", "live", "finished", "postponed"]},
                "score": {
                    "type": "object",
                    "properties": {
                        "home": {"type": "integer", "minimum": 0, "maximum": 20},
                        "away": {"type": "integer", "minimum": 0, "maximum": 20},
                    },
                    "required": ["home", "away"],
                    "additionalProperties": False,
                },
                "scorers": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "player": SHORT,
                            "minute": {"type": "integer", "minimum": 1, "maximum": 120},
                            "team": {"type": "string", "enum": ["home", "away"]},
                        },
                        "required": ["player", "minute", "team"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["home_team", "away_team", "kickoff", "status", "score"],
            "additionalProperties": False,
        },
    ),
    (
        "sensor_reading",
        {
            "type": "object",
            "properties": {
                "device_id": UUID,
                "recorded_at": TIMESTAMP,
                "battery_pct": {"type": "integer", "minimum": 0, "maximum": 100},
                "readings": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "metric": {"type": "string", "enum": ["temperature", "humidity", "pressure", "co2"]},
                            "value": {"type": "number", "minimum": -100, "maximum": 5000},
                            "unit": {"type": "string", "enum": ["C", "%", "hPa", "ppm"]},
                        },
                        "required": ["metric", "value", "unit"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["device_id", "recorded_at", "readings"],
            "additionalProperties": False,
        },
    ),
    (
        "shape",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "circle"},
                        "radius": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                    },
                    "required": ["kind", "radius"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "rectangle"},
                        "width": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                        "height": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                    },
                    "required": ["kind", "width", "height"],
                    "additionalProperties": False,
                },
            ],
        },
    ),
    (
        "webhook_event",
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^evt_[A-Za-z0-9]{12}$"},
                "type": {"type": "string", "enum": ["charge.succeeded", "charge.refunded", "customer.created"]},
                "created": {"type": "integer", "minimum": 1500000000, "maximum": 2000000000},
                "livemode": {"type": "boolean"},
                "data": {
                    "oneOf": [
                        {
                            "type": "object",
                            "properties": {
                                "object": {"const": "charge"},
                                "amount": {"type": "integer", "minimum": 1, "maximum": 1000000},
                                "currency": {"type": "string", "enum": ["usd", "eur"]},
                            },
                            "required": ["object", "amount", "currency"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {"object": {"const": "customer"}, "email": EMAIL},
                            "required": ["object", "email"],
                            "additionalProperties": False,
                        },
                    ]
                },
            },
            "required": ["id", "type", "created", "livemode", "data"],
            "additionalProperties": False,
        },
    ),
    (
        "task_list",
        {
            "type": "object",
            "properties": {
                "list_name": SHORT,
                "tasks": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "integer", "minimum": 1, "maximum": 999},
                            "title": NAME,
                            "done": {"type": "boolean"},
                            "priority": {"type": "string", "enum": ["low", "medium", "high"]},
                            "due": {"type": ["string", "null"], "format": "date"},
                        },
                        "required": ["id", "title", "done", "priority", "due"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["list_name", "tasks"],
            "additionalProperties": False,
        },
    ),
    (
        "meeting_slot",
        {
            "type": "object",
            "properties": {
                "day": {"type": "string", "enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
                "start": {"type": "string", "format": "time"},
                "duration_minutes": {"type": "integer", "enum": [15, 30, 45, 60]},
                "room": {"type": ["string", "null"], "pattern": "^[A-Z][0-9]{3}$"},
            },
            "required": ["day", "start", "duration_minutes", "room"],
            "additionalProperties": False,
        },
    ),
    # ---------------------------------------------------------------- recursive structures
    (
        "tree_node",
        {
            "type": "object",
            "properties": {
                "value": {"type": "integer", "minimum": 0, "maximum": 99},
                "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}},
            },
            "required": ["value"],
            "additionalProperties": False,
        },
    ),
    (
        "comment_thread",
        {
            "$defs": {
                "comment": {
                    "type": "object",
                    "properties": {
                        "author": {"type": "string", "pattern": "^[a-z0-9_]{3,12}$"},
                        "text": {"type": "string", "minLength": 1, "maxLength": 40},
                        "replies": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/comment"}},
                    },
                    "required": ["author", "text"],
                    "additionalProperties": False,
                },
            },
            "type": "object",
            "properties": {
                "post_id": {"type": "integer", "minimum": 1, "maximum": 100000},
                "comments": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/comment"}},
            },
            "required": ["post_id", "comments"],
            "additionalProperties": False,
        },
    ),
    (
        "linked_list",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "value": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                    },
                    "required": ["value"],
                    "additionalProperties": False,
                },
            },
            "$ref": "#/$defs/node",
        },
    ),
    (
        "file_system_entry",
        {
            "$defs": {
                "entry": {
                    "oneOf": [
                        {
                            "type": "object",
                            "properties": {
                                "type": {"const": "file"},
                                "name": {"type": "string", "pattern": "^[a-z0-9_]{1,12}\\.[a-z]{1,4}$"},
                                "size_bytes": {"type": "integer", "minimum": 0, "maximum": 1000000000},
                            },
                            "required": ["type", "name", "size_bytes"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {
                                "type": {"const": "directory"},
                                "name": {"type": "string", "pattern": "^[a-z0-9_]{1,12}$"},
                                "entries": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/entry"}},
                            },
                            "required": ["type", "name", "entries"],
                            "additionalProperties": False,
                        },
                    ]
                },
            },
            "$ref": "#/$defs/entry",
        },
    ),
    (
        "org_chart",
        {
            "$defs": {
                "employee": {
                    "type": "object",
                    "properties": {
                        "name": SHORT,
                        "title": {"type": "string", "enum": ["CEO", "VP", "Director", "Manager", "Engineer"]},
                        "reports": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/employee"}},
                    },
                    "required": ["name", "title"],
                    "additionalProperties": False,
                },
            },
            "type": "object",
            "properties": {"company": SHORT, "head": {"$ref": "#/$defs/employee"}},
            "required": ["company", "head"],
            "additionalProperties": False,
        },
    ),
]

assert len({name for name, _ in SCHEMAS}) == len(SCHEMAS), "schema names must be unique"

# String formats whose length the default backend (xgrammar 0.2.9) does not bound: an email / uri
# string ignores its maxLength, a date-time / time may carry any number of fractional-second
# digits. At temperature 1 the model can run away inside them (finish reason "length").
FREE_LENGTH_FORMATS = ("email", "uri", "date-time", "time")


def formats_used(schema) -> set[str]:
    """Every `format` keyword value in a schema."""
    out: set[str] = set()

    def walk(x):
        if isinstance(x, dict):
            if isinstance(x.get("format"), str):
                out.add(x["format"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(schema)
    return out


def free_length(schema) -> bool:
    """The schema has a value a backend lets run on without bound: a FREE_LENGTH_FORMATS string, or
    a non-integer number (minimum / maximum bound its value, not its digits: llguidance, the
    default for JSON schemas, admits any number of fraction digits)."""
    return bool(formats_used(schema) & set(FREE_LENGTH_FORMATS)) or _has_number(schema)


def _has_number(x) -> bool:
    if isinstance(x, dict):
        t = x.get("type")
        if t == "number" or (isinstance(t, list) and "number" in t):
            return True
        return any(_has_number(v) for k, v in x.items() if k not in ("enum", "const", "default", "examples"))
    if isinstance(x, list):
        return any(_has_number(v) for v in x)
    return False


def describe(name: str) -> str:
    """The instruction used as the prompt for schema `name`."""
    return f"Write one example {name.replace('_', ' ')} as JSON."


def schema_by_name(name: str) -> dict:
    for n, s in SCHEMAS:
        if n == name:
            return s
    raise KeyError(name)


# --- prompts and validation helpers (shared by tests/grammar/test_grammar_engine.py and
# benchmarks/grammar_corpus.py) -----------------------------------------------------------------
def prompt_for(tokenizer, name: str) -> str:
    """The chat prompt (rendered with the model's template) asking for schema `name`."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": describe(name)}], tokenize=False, add_generation_prompt=True
    )


_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
SYNTAX = {
    # RFC 3339 full-date / full-time / date-time, syntax only (no month lengths, no leap years)
    "date": "^" + _DATE + "$",
    "time": "^" + _TIME + "$",
    "date-time": "^" + _DATE + "[Tt]" + _TIME + "$",
    "email": r"^[^@\s]+@[^@\s]+$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    # RFC 3986 absolute URI: scheme ":" then printable ASCII without spaces (no IRIs)
    "uri": r"^[A-Za-z][A-Za-z0-9+.-]*:[!-~]*$",
}
FORMATS = ("date", "date-time", "time", "email", "uuid", "uri", "ipv4")


def format_checker(strict: bool = False):
    """A jsonschema FormatChecker for the formats the corpus uses.

    Default: the syntax the grammar backends enforce (RFC 3339 syntax for date / time /
    date-time, a@b for email, 8-4-4-4-12 hex for uuid, an absolute ASCII URI, a dotted quad for
    ipv4). strict=True also checks calendar validity (no 2023-02-29, no 2024-04-31), which no
    backend enforces fully; the benchmark counts the outputs that only fail that."""
    import datetime
    import ipaddress
    import re

    import jsonschema

    checker = jsonschema.FormatChecker(formats=())
    for fmt, pattern in SYNTAX.items():
        rx = re.compile(pattern)
        if strict and fmt in ("date", "date-time"):

            def check(value, rx=rx):
                if not isinstance(value, str):
                    return True
                if not rx.match(value):
                    return False
                try:
                    datetime.date.fromisoformat(value[:10])
                except ValueError:
                    return False
                return True
        else:

            def check(value, rx=rx):
                return not isinstance(value, str) or bool(rx.match(value))

        checker.checks(fmt)(check)

    def ipv4(value):
        if not isinstance(value, str):
            return True
        try:
            ipaddress.IPv4Address(value)
        except ValueError:
            return False
        return True

    checker.checks("ipv4")(ipv4)
    return checker


def check_output(schema: dict, result: dict, strict: bool = False) -> tuple[str, str]:
    """Classify one engine result for `schema`: ("valid" | "length" | "abort" | "not_json" |
    "invalid", detail)."""
    import json

    import jsonschema

    reason = result["meta_info"]["finish_reason"] or {}
    if reason.get("type") == "length":
        return "length", result["text"][-80:]
    if reason.get("type") == "abort":
        return "abort", str(reason.get("message"))
    try:
        value = json.loads(result["text"])
    except ValueError as e:
        return "not_json", f"{e}: {result['text'][:200]!r}"
    errors = sorted(
        jsonschema.Draft202012Validator(schema, format_checker=format_checker(strict)).iter_errors(value),
        key=lambda e: list(e.path),
    )
    if errors:
        e = errors[0]
        return "invalid", f"{'/'.join(map(str, e.path))}: {e.message[:200]}"
    return "valid", ""
